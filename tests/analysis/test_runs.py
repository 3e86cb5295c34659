"""Both run kinds answer the one interface of analysis/runs.py with the same numbers on the same input."""

from __future__ import annotations

import numpy as np
import pytest

from headscope.analysis.capture import capture
from headscope.analysis.errors import InputError
from headscope.analysis.runs import AttentionRun
from headscope.analysis.statistics_run import STATS_METRICS, capture_statistics, exact_region

N = 128


@pytest.fixture(scope="module")
def both(real_model):
    text = open("data/niah/haystack_prose.txt", encoding="utf-8").read()
    ids = real_model.encode(text)[:N]
    return capture(real_model, ids, pattern_dtype="float32", max_tokens=N), capture_statistics(real_model, ids)


def test_both_kinds_implement_the_interface_with_the_same_sizes(both):
    run, stats = both
    for r in both:
        assert isinstance(r, AttentionRun)
        assert (r.n_layers, r.n_heads, r.n_tokens) == (30, 9, N)
        assert r.short_id == r.key[:12] and r.meta()["n_tokens"] == N
    assert run.has_patterns and not stats.has_patterns
    assert run.block_size == 1 and stats.block_size == 1  # 128 tokens: one token per block
    assert set(stats.metrics) <= set(run.metrics)
    assert run.mode == "full patterns" and stats.mode.startswith("statistics mode")


def test_scores_received_sinks_and_regions_agree(real_model, both):
    run, stats = both
    for name in STATS_METRICS:
        np.testing.assert_allclose(stats.head_scores(name), run.head_scores(name), atol=2e-6, err_msg=name)
    np.testing.assert_allclose(stats.received_attention(), run.received_attention(), atol=5e-6, equal_nan=True)
    np.testing.assert_array_equal(stats.sink_counts(), run.sink_counts())
    assert run.sink_counts()[0] > 0  # SmolLM2's first token is a sink for some heads
    np.testing.assert_allclose(stats.attention_overview(7, 3), run.attention_overview(7, 3), atol=1e-7)
    region = stats.attention_region(7, 3, (60, 90), (0, 70), model=real_model)
    np.testing.assert_array_equal(region, exact_region(real_model, stats, 7, 3, (60, 90), (0, 70)))
    np.testing.assert_allclose(region, run.attention_region(7, 3, (60, 90), (0, 70)), atol=1e-6)
    assert set(run.kept_arrays()) == {"patterns"}
    assert {"col_sum", "pooled", "row_entropy"} <= set(stats.kept_arrays())


def test_only_a_statistics_run_refuses_what_needs_patterns(both):
    run, stats = both
    run.require_patterns("Attention rollout")  # nothing to say
    with pytest.raises(InputError, match=f"Attention rollout needs full attention patterns; this {N:,}-token run"):
        stats.require_patterns("Attention rollout")
    with pytest.raises(InputError, match="Unknown metric 'bogus'"):
        run.head_scores("bogus")
    with pytest.raises(InputError, match="Unknown score 'bogus'"):
        stats.head_scores("bogus")
