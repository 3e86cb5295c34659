"""app/views/flow.py: the Flow page's strips are the analyses' numbers; bad targets are explained."""

import numpy as np
import pytest

from headscope.analysis.capture import capture
from headscope.analysis.errors import InputError
from headscope.analysis.flow import attention_flow
from headscope.analysis.rollout import rollout
from headscope.app.views import flow as views


@pytest.fixture
def run(tiny_model):
    return capture(tiny_model, "The keys to the cabinet are on the table.", pattern_dtype="float32")


def test_relevance_views_are_the_analyses(run):
    target = run.n_tokens - 2
    _, rows = views.relevance_view(run, {"target": target, "method": "rollout"})
    np.testing.assert_allclose([r["relevance"] for r in rows], rollout(run.patterns)[target, : target + 1])
    _, rows = views.relevance_view(run, {"target": target, "method": "flow", "drop_sink": True})
    np.testing.assert_allclose([r["relevance"] for r in rows],
                               attention_flow(run.patterns, target=target, drop_sinks=(0,))[: target + 1])
    _, rows = views.relevance_view(run, {"target": target, "method": "attention"})
    last = run.patterns[-1].astype(float).mean(0)[target, : target + 1]
    np.testing.assert_allclose([r["relevance"] for r in rows], last, rtol=1e-6)


def test_rollout_layers_last_row_is_the_rollout(run):
    _, rows = views.rollout_layers_view(run, {"target": 3})
    last_layer = [r["rollout"] for r in rows if r["layer"] == run.patterns.shape[0] - 1]
    np.testing.assert_allclose(last_layer, rollout(run.patterns)[3, :4])


def test_flow_limit_and_bad_targets_are_explained(run, monkeypatch):
    with pytest.raises(InputError, match="out of range"):
        views.relevance_view(run, {"target": run.n_tokens, "method": "rollout"})
    with pytest.raises(InputError, match="Unknown relevance method"):
        views.relevance_view(run, {"target": 1, "method": "magic"})
    monkeypatch.setenv("HEADSCOPE_MAX_FLOW_TOKENS", "4")
    with pytest.raises(InputError, match="limited to 4 tokens"):
        views.token_relevance(run, "flow", 2, "max", False)
    # the position-corrected flow strip says so too (it raised KeyError: the Flow page of any run past
    # the limit showed "Something went wrong" and none of its strips)
    with pytest.raises(InputError, match="limited to 4 tokens"):
        views.relevance_view(run, {"target": 2, "method": "flow_debiased"})
    _, rows = views.relevance_view(run, {"target": 2, "method": "rollout_debiased"})
    assert len(rows) == 3
