"""The Flow page: its strips are the numbers the faithfulness chart scores, and (in real Chromium
against a real server on the embedded model) a click picks the target, every strip has a shared,
numbered colour scale, and the sink option is explained beside it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from analysis.attribution import RELEVANCE_METHODS, attribute, spearman
from analysis.capture import capture
from analysis.rollout import FUSIONS
from app import views

TEXT = "The keys to the old wooden cabinet are"


@pytest.fixture(scope="module")
def flow_run(real_model):
    """A run as the page stores it (float16 patterns), on the embedded model."""
    return capture(real_model, TEXT)


@pytest.mark.integration
@pytest.mark.parametrize("drop_sink", [False, True], ids=["sink-kept", "sink-dropped"])
@pytest.mark.parametrize("fusion", FUSIONS)
def test_each_strip_is_exactly_what_the_faithfulness_chart_scores(real_model, flow_run, fusion, drop_sink):
    run = flow_run
    target = run.n_tokens - 2
    params = {"target": target, "fusion": fusion, "drop_sink": drop_sink}
    on_input = views.attribution_for(run, target, fusion, drop_sink)  # what "Faithfulness on this input" ranks
    _, rho_rows = views.faithfulness_input_view(run, params)
    rho = {r["method"]: r["spearman"] for r in rho_rows}
    # The built-in set's path: each prompt captured afresh in float32, same definition.
    fresh = attribute(real_model, run.token_ids, position=target, fusion=fusion, drop_sinks=(0,) if drop_sink else ())
    for method in RELEVANCE_METHODS:
        _, rows = views.relevance_view(run, {**params, "method": method})
        strip = np.array([r["relevance"] for r in rows])
        assert strip.shape == (target + 1,)
        np.testing.assert_array_equal(strip, on_input.scores[method], err_msg=method)
        assert rho[method] == pytest.approx(spearman(strip, on_input.scores["ablation"]), abs=1e-12), method
        np.testing.assert_allclose(strip, fresh.scores[method], atol=3e-3, err_msg=method)  # float16 vs float32


@pytest.mark.integration
def test_the_options_change_the_scored_raw_attention(flow_run):
    """The combinations above are not all one number: fusion and the sink change raw attention."""
    target = flow_run.n_tokens - 1
    shown = {(f, d): views.token_relevance(flow_run, "attention", target, f, d) for f in FUSIONS for d in (False, True)}
    assert shown[("mean", True)][0] == 0.0 < shown[("mean", False)][0]
    assert not np.allclose(shown[("max", False)], shown[("mean", False)], atol=1e-3)
    assert not np.allclose(shown[("min", False)], shown[("mean", False)], atol=1e-3)
