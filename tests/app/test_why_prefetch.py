"""Showing a run on the Attention page starts the why panel's capture in the background, so the first click
on a cell of its heatmap finds it made (:func:`headscope.analysis.qk_cell.prefetch`).

Through Flask's test client on the app as ``headscope serve`` builds it: the render request a run's URL
sends, then a click's request for the why panel."""

from __future__ import annotations

import json
import time
from collections import OrderedDict

import numpy as np

from headscope.analysis.store import Store
from headscope.app.context import AppContext, get_context, set_context
from headscope.app.server import create_app
from tests.app.forged_posts import request_body

UPDATE = "/_dash-update-component"


def _post(client, dep: dict, values: dict) -> dict:
    """``dep``'s request as the renderer sends it, with ``values`` keyed ``id.property``."""
    body = request_body(dep, values)
    answer = client.post(UPDATE, json=body)
    assert answer.status_code in (200, 204), answer.data[:300]
    return answer.get_json() if answer.status_code == 200 else {}


def test_a_shown_run_is_captured_before_the_first_click_which_then_makes_no_forward_pass(tmp_path, real_model,
                                                                                         monkeypatch):
    from headscope.analysis import qk_cell
    from headscope.analysis.statistics_run import capture_for_page

    monkeypatch.setattr(qk_cell, "_captures", OrderedDict())
    made: list[int] = []
    real = qk_cell.capture_components

    def counted(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(qk_cell, "capture_components", counted)
    token_ids = [int(t) for t in np.random.default_rng(4).integers(100, 5000, 40)]
    store = Store(tmp_path / "store")
    run = capture_for_page(real_model, token_ids, store, len(token_ids))
    before = get_context()
    try:
        app = create_app(AppContext(store=store))
        client = app.server.test_client()
        client.get("/")
        deps = json.loads(client.get("/_dash-dependencies").data)
        render = next(d for d in deps if d["output"].strip(".").split("...")[0] == "hs-grid.figure")
        why = next(d for d in deps if "attn-hs-why-message.children" in d["output"])
        shown = f"?run={run.key[:16]}"
        _post(client, render, {"attn-hs-url.search": shown, "attn-hs-url.pathname": "/"})
        end = time.monotonic() + 120
        while not qk_cell.is_cached(real_model, token_ids) and time.monotonic() < end:
            time.sleep(0.05)
        assert qk_cell.is_cached(real_model, token_ids) and len(made) == 1
        answer = _post(client, why, {"attn-hs-url.search": f"{shown}&layer=5&head=2&query=39&key=7",
                                     "attn-hs-why-group.value": "layer", "attn-hs-url.pathname": "/"})
        assert "model's own score before softmax" in json.dumps(answer)
        assert len(made) == 1  # the click used the capture made when the run was shown
    finally:
        set_context(before)
