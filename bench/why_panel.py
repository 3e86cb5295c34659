"""Click → "why" panel on the Attention page, on a stored run of the embedded model (#41: within 1 s).

A run of ``--tokens`` random tokens is stored and the app created in this process; each "click" is the
request the browser sends when a heatmap cell's query and key go into the URL (the ``explain_cell``
callback, through Flask's test client: the server's whole answer, JSON included, not the browser's
drawing), and "show" is the request that draws the run (the page's ``render``), which starts the why
panel's capture in the background (:func:`headscope.analysis.qk_cell.prefetch`). Rows:

- baseline: :func:`headscope.analysis.qk_attribution.qk_attribution` of the first cell without a capture
  (its own forward pass), as every click would cost without the cache;
- show, then the capture in the background: the render's answer, and when the capture is made after it;
- first click after the capture: what a user who clicks once it is made waits;
- first click right after show: a click sent as soon as the render answers (waits for the rest);
- first click, nothing captured: a link straight to a cell (no run shown before), which makes the capture
  at the click, as every first click did without the prefetch;
- later clicks at other cells and heads;
- the capture alone (median of two, alternated): as it is, unembedding the last position only, and with
  every position's logits as a plain forward pass computes them (the capture keeps none of them).

Parity first: the panel's check line carries the score ``qk_attribution`` gives.

    OMP_NUM_THREADS=2 .venv/bin/python bench/why_panel.py [--tokens 512 --later 5]
"""

from __future__ import annotations

import argparse
import re
import resource
import tempfile
import time
from pathlib import Path

import numpy as np


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    from headscope.analysis import qk_cell, residual_components
    from headscope.analysis.models import load_model
    from headscope.analysis.qk_attribution import qk_attribution
    from headscope.analysis.statistics_run import capture_for_page
    from headscope.analysis.store import Store
    from headscope.app.context import AppContext
    from headscope.app.server import create_app

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--later", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = load_model("smollm2-135m")
    rng = np.random.default_rng(args.seed)
    ids = [int(t) for t in rng.integers(100, model.vocab_size - 100, args.tokens)]
    store = Store(Path(tempfile.mkdtemp(prefix="why-bench-")) / "store")
    run = capture_for_page(model, ids, store, args.tokens)
    assert run.has_patterns and run.block_size == 1, "the run must be shown token by token"
    app = create_app(AppContext(store=store))
    client = app.server.test_client()
    client.get("/")  # the pages' callbacks join the app on the first request
    deps = client.get("/_dash-dependencies").get_json()
    dep = next(d for d in deps if "attn-hs-why-message.children" in d["output"])
    render = next(d for d in deps if d["output"].strip(".").split("...")[0] == "hs-grid.figure")

    def request(dep: dict, values: dict) -> tuple[float, str]:
        outs = [{"id": p.rpartition(".")[0], "property": p.rpartition(".")[2]}
                for p in dep["output"].strip(".").split("...")]
        body = {"output": dep["output"], "outputs": outs if dep["output"].startswith("..") else outs[0],
                "changedPropIds": ["attn-hs-url.search"],
                **{part: [{"id": x["id"], "property": x["property"], "value": values.get(f"{x['id']}.{x['property']}")}
                          for x in dep[part]] for part in ("inputs", "state")}}
        started = time.perf_counter()
        answer = client.post("/_dash-update-component", json=body)
        seconds = time.perf_counter() - started
        assert answer.status_code in (200, 204), answer.data[:500]
        return seconds, answer.data.decode()

    shown = f"?run={run.key[:16]}"

    def show() -> float:
        return request(render, {"attn-hs-url.search": shown, "attn-hs-url.pathname": "/"})[0]

    def click(layer: int, head: int, query: int, key: int) -> tuple[float, str]:
        seconds, text = request(dep, {"attn-hs-url.search": f"{shown}&layer={layer}&head={head}&query={query}&key={key}",
                                      "attn-hs-why-group.value": "layer", "attn-hs-url.pathname": "/"})
        found = re.search(r"model's own score before softmax: (-?[0-9.]+)", text)
        assert found, text[:500]
        return seconds, found[1]

    def captured() -> float:
        started = time.perf_counter()
        while not qk_cell.is_cached(model, ids):
            time.sleep(0.005)
        return time.perf_counter() - started

    n = args.tokens
    cells = [(20, 3, n - 1, n // 3)] + [(int(rng.integers(1, model.n_layers)), int(rng.integers(model.n_heads)),
                                         int(q), int(rng.integers(q + 1))) for q in rng.integers(n // 2, n, args.later)]
    started = time.perf_counter()
    base = qk_attribution(model, ids, *cells[0])
    baseline = time.perf_counter() - started
    rows = []
    # the prefetch first: its rows bear the process's first figures and first captured pass, not the
    # link's row below
    rendered = show()
    rows.append(("show (render answers)", None, rendered))
    rows.append(("  capture made, after show", None, rendered + captured()))
    seconds, score = click(*cells[0])
    assert abs(float(score) - base.score) <= 2e-6 + 1e-6 * abs(base.score), (score, base.score)
    rows.append(("first click after capture", cells[0], seconds))
    qk_cell.clear_captures()
    show()
    rows.append(("first click right after show", cells[0], click(*cells[0])[0]))
    qk_cell.clear_captures()
    seconds, score = click(*cells[0])  # a link straight to a cell: the capture is made at the click
    assert abs(float(score) - base.score) <= 2e-6 + 1e-6 * abs(base.score), (score, base.score)
    rows.append(("first click, nothing captured", cells[0], seconds))
    for cell in cells[1:]:
        rows.append(("later click", cell, click(*cell)[0]))
    # the capture alone, as it is (the last position unembedded) and with every position's logits (as it was
    # before), alternated twice in this run
    def capture_seconds(every_logit: bool) -> float:
        keep = residual_components._last_logits_only
        if every_logit:
            residual_components._last_logits_only = lambda model: {}
        try:
            started = time.perf_counter()
            residual_components.capture_components(model, ids, range(n), attention_layers=range(model.n_layers))
            return time.perf_counter() - started
        finally:
            residual_components._last_logits_only = keep

    qk_cell.clear_captures()
    pairs = [(capture_seconds(True), capture_seconds(False)) for _ in range(2)]
    rows.append(("capture, every position's logits", None, float(np.median([b for b, _ in pairs]))))
    rows.append(("capture, last position's logits", None, float(np.median([a for _, a in pairs]))))
    print(f"why panel, {n} tokens, SmolLM2-135M, CPU (torch threads: {__import__('torch').get_num_threads()})")
    print(f"{'what':<32}{'cell (L, H, q, k)':<24}{'seconds':>9}{'× baseline':>12}")
    print(f"{'baseline: qk_attribution':<32}{str(cells[0]):<24}{baseline:>9.3f}{1.0:>12.2f}")
    for what, cell, seconds in rows:
        print(f"{what:<32}{'' if cell is None else str(cell):<24}{seconds:>9.3f}{seconds / baseline:>12.3f}")
    later = [s for w, _, s in rows if w == "later click"]
    if later:
        print(f"later clicks: median {np.median(later):.3f} s, max {max(later):.3f} s; peak memory {peak_mb():.0f} MB")


if __name__ == "__main__":
    main()
