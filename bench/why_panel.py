"""Click → "why" panel on the Attention page, on a stored run of the embedded model (#41: within 1 s).

A run of ``--tokens`` random tokens is stored and the app created in this process; each "click" is the
request the browser sends when a heatmap cell's query and key go into the URL (the ``explain_cell``
callback, through Flask's test client: the server's whole answer, JSON included, not the browser's
drawing). The first click of a run makes its one cached capture (a hooked forward pass); later clicks, at
other cells and heads, reuse it. Baseline: :func:`headscope.analysis.qk_attribution.qk_attribution` of
the same cell without a capture (its own forward pass), as every click would cost without the cache.
Parity first: the panel's check line carries the score ``qk_attribution`` gives.

    OMP_NUM_THREADS=2 .venv/bin/python bench/why_panel.py [--tokens 512 --later 5]
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import tempfile
import time
from pathlib import Path

import numpy as np


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
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
    deps = client.get("/_dash-dependencies").get_json()
    dep = next(d for d in deps if "attn-hs-why-message.children" in d["output"])
    outputs = [{"id": p.rpartition(".")[0], "property": p.rpartition(".")[2]} for p in dep["output"].strip(".").split("...")]

    def click(layer: int, head: int, query: int, key: int) -> tuple[float, str]:
        search = f"?run={run.key[:16]}&layer={layer}&head={head}&query={query}&key={key}"
        body = {"output": dep["output"], "outputs": outputs, "changedPropIds": ["attn-hs-url.search"],
                "inputs": [{"id": "attn-hs-url", "property": "search", "value": search},
                           {"id": "attn-hs-why-group", "property": "value", "value": "layer"}],
                "state": [{"id": "attn-hs-url", "property": "pathname", "value": "/"},
                          {"id": "attn-hs-why-shown", "property": "data", "value": None}]}
        started = time.perf_counter()
        answer = client.post("/_dash-update-component", json=body)
        seconds = time.perf_counter() - started
        text = json.dumps(answer.get_json())
        found = re.search(r"model's own score before softmax: (-?[0-9.]+)", text)
        assert answer.status_code == 200 and found, text[:500]
        return seconds, found[1]

    n = args.tokens
    cells = [(20, 3, n - 1, n // 3)] + [(int(rng.integers(1, model.n_layers)), int(rng.integers(model.n_heads)),
                                         int(q), int(rng.integers(q + 1))) for q in rng.integers(n // 2, n, args.later)]
    started = time.perf_counter()
    base = qk_attribution(model, ids, *cells[0])
    baseline = time.perf_counter() - started
    rows = []
    for i, cell in enumerate(cells):
        seconds, shown = click(*cell)
        if i == 0:
            assert abs(float(shown) - base.score) <= 2e-6 + 1e-6 * abs(base.score), (shown, base.score)
        rows.append(("first click (capture)" if i == 0 else "later click", cell, seconds))
    print(f"why panel, {n} tokens, SmolLM2-135M, CPU (torch threads: {__import__('torch').get_num_threads()})")
    print(f"{'what':<28}{'cell (L, H, q, k)':<24}{'seconds':>9}{'× baseline':>12}")
    print(f"{'baseline: qk_attribution':<28}{str(cells[0]):<24}{baseline:>9.3f}{1.0:>12.2f}")
    for what, cell, seconds in rows:
        print(f"{what:<28}{str(cell):<24}{seconds:>9.3f}{seconds / baseline:>12.3f}")
    later = [s for w, _, s in rows if w == "later click"]
    if later:
        print(f"later clicks: median {np.median(later):.3f} s, max {max(later):.3f} s; peak memory {peak_mb():.0f} MB")


if __name__ == "__main__":
    main()
