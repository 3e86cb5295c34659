"""The README's "From Python (notebooks)" example, run exactly as written, on the embedded model."""

from __future__ import annotations

import numpy as np
import pytest

from tests.readme_example import notebook_example

pytestmark = pytest.mark.integration


def test_the_notebook_example_runs_and_draws_the_pages_grid(tmp_path, monkeypatch, capsys):
    from headscope.analysis.score_registry import HEAD_METRICS
    from headscope.app.views import VIEWS

    monkeypatch.chdir(tmp_path)  # anything the example writes stays in the test's folder
    namespace: dict = {}
    exec(compile(notebook_example(), "README.md (From Python)", "exec"), namespace)

    model, run, scores, grid = namespace["model"], namespace["run"], namespace["scores"], namespace["grid"]
    # A short text keeps the example quick (capture ~0.6 s; wall time is mostly imports and the
    # model load, which depend on the machine's load, so they are not asserted here).
    assert run.n_tokens <= 32
    assert scores.shape == (model.n_layers, model.n_heads) == (30, 9)
    assert np.isfinite(scores).all() and ((0 <= scores) & (scores <= 1)).all()
    # The figure is the one the Attention page draws for this run, metric and selected head.
    layer, head = namespace["layer"], namespace["head"]
    assert scores[layer, head] == scores.max()
    page_grid, _ = VIEWS["head_grid"].build(run, {"metric": "previous_token", "layer": layer, "head": head})
    assert grid.to_json() == page_grid.to_json()
    assert grid.layout.title.text == f"{HEAD_METRICS['previous_token'].label} per head"
    assert np.asarray(grid.data[0].z, dtype=float).shape == (30, 9)
    heatmap = namespace["heatmap"]
    assert heatmap.layout.title.text == f"Attention of layer {layer}, head {head}"
    printed = capsys.readouterr().out
    assert f"{run.n_tokens} tokens" in printed and f"layer {layer}, head {head}" in printed
