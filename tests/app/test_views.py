import numpy as np
import pytest

from analysis.capture import capture
from analysis.errors import InputError
from analysis.flow import attention_flow
from analysis.rollout import rollout
from app import views


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


def test_sink_map_view_is_received_attention_averaged_over_heads(run):
    _, rows = views.sink_map_view(run, {})
    p = run.patterns.astype(float)
    n = run.n_tokens
    j = 2  # attention key 2 receives from queries 3..n-1, averaged, then over heads
    expected = p[1, :, j + 1 :, j].sum(-1).mean() / (n - 1 - j)
    got = next(r["mean_received"] for r in rows if r.get("layer") == 1 and r.get("pos") == j)
    assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.integration
def test_sink_title_says_when_a_text_is_too_short_to_call_sinks(real_model):
    import re

    from analysis.streaming import SINK_MIN_LATER

    short = capture(real_model, "The cat sat on the mat by the door.")
    assert short.n_tokens <= SINK_MIN_LATER  # no position has enough later tokens
    fig, _ = views.sink_map_view(short, {})
    title = fig.layout.title.text
    assert "too short to call sinks" in title and "is a sink for 0 heads" not in title
    assert f"{short.n_tokens} tokens" in title and f"at least {SINK_MIN_LATER} later tokens" in title

    text = ("When Mary and John went to the store, John gave a drink to Mary. The cat sat on the mat, "
            "and the dog slept by the door until the evening came.")
    long = capture(real_model, text)
    fig, _ = views.sink_map_view(long, {})
    title = fig.layout.title.text
    assert "too short" not in title
    assert int(re.search(r"position 0 is a sink for (\d+) heads", title)[1]) > 0  # SmolLM2 sinks on 0
    assert f"positions 0–{long.n_tokens - 1 - SINK_MIN_LATER} checked" in title


def test_sink_title_in_statistics_mode_says_the_same(tiny_model):
    from analysis.statistics_run import capture_statistics
    from analysis.streaming import SINK_MIN_LATER

    for text in ("The keys to the cabinet are on the table.",
                 "The keys to the cabinet are on the table, and the table stands in the hall by the door "
                 "that opens onto the garden."):
        full = capture(tiny_model, text, pattern_dtype="float32")
        stats = capture_statistics(tiny_model, text)
        titles = [views.sink_map_view(r, {})[0].layout.title.text for r in (full, stats)]
        if full.n_tokens <= SINK_MIN_LATER:
            assert all("too short to call sinks" in t for t in titles)
        else:
            checked = f"positions 0–{full.n_tokens - 1 - SINK_MIN_LATER} checked"
            assert all(checked in t and "too short" not in t for t in titles)
        assert titles[0].split(":")[0] == titles[1].split(":")[0]
    assert full.n_tokens > SINK_MIN_LATER  # the second text is long enough to check position 0
