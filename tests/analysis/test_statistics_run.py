"""Long runs: statistics instead of patterns give the same scores as patterns (512 tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from headscope.analysis.capture import capture
from headscope.analysis.errors import InputError
from headscope.analysis.evidence import evidence_score
from headscope.analysis.score_registry import HEAD_METRICS
from headscope.analysis.statistics_run import (
    STATS_METRICS,
    capture_statistics,
    evidence_from_statistics,
    exact_region,
    load_stats_run,
    received,
    statistics_score,
)
from headscope.analysis.streaming import sink_map, streaming_score

N = 512


@pytest.fixture(scope="module")
def both(real_model):
    text = open("data/niah/haystack_prose.txt", encoding="utf-8").read()
    ids = real_model.encode(text)[:N]
    assert len(ids) == N
    run = capture(real_model, ids, pattern_dtype="float32", max_tokens=N)
    stats = capture_statistics(real_model, ids, sink=4, window=64, spans=[(100, 130), (200, 210)])
    return run, stats


@pytest.mark.parametrize("name", STATS_METRICS)
def test_scores_from_statistics_equal_scores_from_patterns(both, name):
    run, stats = both
    expected = HEAD_METRICS[name].compute(run.patterns, run.token_ids)
    got = statistics_score(stats, name)
    assert got.shape == expected.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, atol=2e-6, rtol=0)


def test_detectors_on_a_repeated_text_and_too_many_cells(real_model, monkeypatch):
    """Induction on text repeated twice is high for induction heads; the cell cap gives nan."""
    import headscope.analysis.statistics_run as sr

    ids = real_model.encode("The quick brown fox jumps over the lazy dog while seven wizards juggle.") * 3
    run = capture(real_model, ids, pattern_dtype="float32", max_tokens=len(ids))
    stats = capture_statistics(real_model, ids)
    for name in ("duplicate_token", "induction"):
        np.testing.assert_allclose(statistics_score(stats, name), HEAD_METRICS[name].compute(run.patterns, ids),
                                   atol=2e-6)
    assert statistics_score(stats, "induction").max() > 0.5  # SmolLM2 has induction heads
    monkeypatch.setattr(sr, "MAX_DETECTOR_CELLS", 10)
    capped = capture_statistics(real_model, ids[:-1])
    assert np.isnan(statistics_score(capped, "induction")).all()
    assert np.isfinite(statistics_score(capped, "entropy")).all()


def test_streaming_with_other_sink_and_window(real_model, both):
    run, _ = both
    stats = capture_statistics(real_model, run.token_ids, sink=1, window=16)
    np.testing.assert_allclose(statistics_score(stats, "streaming"), streaming_score(run.patterns, sink=1, window=16),
                               atol=2e-6)
    with pytest.raises(InputError, match="S=1, W=16"):
        statistics_score(stats, "streaming", sink=4, window=64)


def test_sink_map_evidence_pooled_loss_and_exact_region(real_model, both):
    run, stats = both
    np.testing.assert_allclose(received(stats), sink_map(run.patterns).received, atol=5e-6, equal_nan=True)
    np.testing.assert_allclose(
        evidence_from_statistics(stats, (400, 420), [0, 1]),
        evidence_score(run.patterns, (400, 420), [(100, 130), (200, 210)]), atol=1e-6)
    B = stats.block_size
    assert B == 4 and stats.pooled.shape == (30, 9, N // B, N // B)
    brute = run.patterns.reshape(30, 9, N // B, B, N // B, B).mean((3, 5))
    # two paths to the same probabilities (the fused statistics pass, the eager pattern): their float32
    # sums differ by CPU, up to 3.6e-7 on an AMX machine; the same bound as the exact region's below
    np.testing.assert_allclose(stats.pooled, brute, atol=1e-6)
    np.testing.assert_allclose(stats.token_loss, run.token_loss, atol=1e-4, equal_nan=True)
    assert (stats.top_ids == run.top_ids).mean() > 0.999
    region = exact_region(real_model, stats, 7, 3, (200, 260), (0, 250))
    np.testing.assert_allclose(region, run.patterns[7, 3, 200:260, 0:250], atol=1e-6)


def test_unknown_scores_and_bad_regions_say_why(real_model, both, monkeypatch):
    import headscope.analysis.statistics_run as sr

    monkeypatch.setattr(sr, "MAX_REGION", 100)  # the default is 256
    _, stats = both
    with pytest.raises(InputError, match="Unknown score 'nonexistent'"):
        statistics_score(stats, "nonexistent")
    with pytest.raises(InputError, match="at most 100 × 100"):
        exact_region(real_model, stats, 0, 0, (0, 101), (0, 10))
    with pytest.raises(InputError, match="Layer 30 is out of range: the model has layers 0..29"):
        exact_region(real_model, stats, 30, 0, (0, 5), (0, 5))
    with pytest.raises(InputError, match="holds no cell"):
        exact_region(real_model, stats, 0, 0, (600, 700), (0, 5))
    with pytest.raises(InputError, match="outside"):
        capture_statistics(real_model, stats.token_ids[:50], spans=[(40, 60)])


def test_stored_and_loaded(real_model, store, both):
    run, _ = both
    ids = run.token_ids[:200]
    first = capture_statistics(real_model, ids, store=store)
    loaded = load_stats_run(store, first.key)
    assert loaded is not None and loaded.tokens == first.tokens
    for name in first.rows:
        np.testing.assert_array_equal(loaded.rows[name], first.rows[name])
    np.testing.assert_array_equal(loaded.pooled, first.pooled)
    again = capture_statistics(real_model, ids, store=store)  # loaded, not recomputed
    assert again.seconds == first.seconds


def test_page_runs_keep_patterns_up_to_the_limit_and_statistics_above(real_model, store, monkeypatch):
    from headscope.analysis.capture import Run
    from headscope.analysis.statistics_run import StatsRun, capture_for_page

    short = capture_for_page(real_model, "A short text keeps its full patterns.", store, max_tokens=64)
    assert isinstance(short, Run) and short.patterns.shape[-1] == short.n_tokens
    long = capture_for_page(real_model, "A text longer than the limit. " * 20, store, max_tokens=64)
    assert isinstance(long, StatsRun) and long.n_tokens > 64
    with pytest.raises(InputError, match="the model's context of 8,192 tokens") as e:
        capture_for_page(real_model, "far too long " * 5000, store, max_tokens=64)
    assert "HEADSCOPE_" not in str(e.value)  # no setting lifts the model's context
    monkeypatch.setenv("HEADSCOPE_MAX_STATS_TOKENS", "100")
    with pytest.raises(InputError, match="HEADSCOPE_MAX_STATS_TOKENS"):
        capture_for_page(real_model, "A text longer than the limit. " * 20, store, max_tokens=64)

