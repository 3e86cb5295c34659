"""Streaming score and sink map against hand-computed patterns and a brute-force loop."""

import numpy as np
import pytest

from analysis.head_summary import HEAD_METRICS
from analysis.streaming import SINK_MIN_LATER, sink_checked_positions, sink_map, streaming_score


def random_causal(rng, n_layers, n_heads, n, alpha=1.0):
    a = np.zeros((n_layers, n_heads, n, n))
    for i in range(n):
        a[:, :, i, : i + 1] = rng.dirichlet(np.full(i + 1, alpha), size=(n_layers, n_heads))
    return a


def one_hot_rows(n, targets):
    a = np.zeros((n, n))
    a[np.arange(n), targets] = 1.0
    return a


def brute_streaming(a, sink, window):
    n = a.shape[-1]
    out = np.zeros(a.shape[:2])
    for layer in range(a.shape[0]):
        for head in range(a.shape[1]):
            rows = []
            for i in range(sink + window, n):
                keys = set(range(sink)) | set(range(i - window + 1, i + 1))
                rows.append(sum(a[layer, head, i, j] for j in keys))
            out[layer, head] = np.mean(rows)
    return out


def test_streaming_score_by_hand():
    # One head, 5 tokens, S = 1, W = 2: rows 3 and 4 count.
    # row 3 = [.5, .1, .1, .3]     -> sink .5 + window (keys 2, 3) .4 = .9
    # row 4 = [.1, .4, .3, .1, .1] -> sink .1 + window (keys 3, 4) .2 = .3      mean = .6
    a = np.zeros((1, 1, 5, 5))
    a[0, 0, 0, 0] = 1
    a[0, 0, 1, :2] = [0.5, 0.5]
    a[0, 0, 2, :3] = [0.2, 0.3, 0.5]
    a[0, 0, 3, :4] = [0.5, 0.1, 0.1, 0.3]
    a[0, 0, 4, :5] = [0.1, 0.4, 0.3, 0.1, 0.1]
    np.testing.assert_allclose(streaming_score(a, sink=1, window=2), [[0.6]], atol=1e-12)


def test_pure_sink_and_local_heads_score_one_a_far_head_scores_zero():
    n = 40
    sink_head = np.zeros((n, n))
    sink_head[:, 0] = 1.0
    local_head = np.eye(n)
    far_head = one_hot_rows(n, [min(i, 1) for i in range(n)])  # always key 1: past the sink, far away
    a = np.stack([sink_head, local_head, far_head])[None]
    # S = 1, W = 4: rows 5.. count; key 1 is neither the sink (key 0) nor within 4 of row i >= 5
    np.testing.assert_allclose(streaming_score(a, sink=1, window=4), [[1.0, 1.0, 0.0]], atol=1e-12)
    # with S = 2 key 1 is a sink: the far head becomes a streaming head
    np.testing.assert_allclose(streaming_score(a, sink=2, window=4), [[1.0, 1.0, 1.0]], atol=1e-12)


def test_streaming_score_matches_brute_force_in_chunks():
    rng = np.random.default_rng(0)
    a = random_causal(rng, 2, 3, 30)
    for sink, window in [(0, 1), (1, 3), (4, 8)]:
        expected = brute_streaming(a, sink, window)
        np.testing.assert_allclose(streaming_score(a, sink, window, chunk=7), expected, atol=1e-12)
        # float16 patterns (as stored) give the same score to float16 precision
        np.testing.assert_allclose(streaming_score(a.astype(np.float16), sink, window), expected, atol=2e-3)


def test_streaming_score_short_sequence_is_nan_and_bad_sizes_raise():
    a = random_causal(np.random.default_rng(1), 1, 1, 6)
    assert np.isnan(streaming_score(a, sink=2, window=4)).all()
    with pytest.raises(ValueError, match="window"):
        streaming_score(a, sink=1, window=0)
    with pytest.raises(ValueError, match="N, N"):
        streaming_score(a[0], 1, 1)


def test_sink_map_by_hand():
    # 4 tokens. received(j) = mean of column j over rows i > j.
    a = np.zeros((1, 1, 4, 4))
    a[0, 0, 0, 0] = 1
    a[0, 0, 1, :2] = [0.6, 0.4]
    a[0, 0, 2, :3] = [0.5, 0.2, 0.3]
    a[0, 0, 3, :4] = [0.1, 0.6, 0.1, 0.2]
    sm = sink_map(a, threshold=0.3, min_later=1)
    # j=0: (.6+.5+.1)/3 = .4 ; j=1: (.2+.6)/2 = .4 ; j=2: .1/1 ; j=3: no later query
    np.testing.assert_allclose(sm.received[0, 0, :3], [0.4, 0.4, 0.1], atol=1e-12)
    assert np.isnan(sm.received[0, 0, 3])
    assert sm.positions == [0, 1] and sm.mid_sequence == [1]
    # min_later excludes keys seen by too few queries
    assert sink_map(a, threshold=0.3, min_later=3).positions == [0]


def test_sink_map_flags_a_mid_sequence_sink():
    rng = np.random.default_rng(2)
    n = 60
    a = random_causal(rng, 2, 2, n, alpha=5.0)  # diffuse background
    # Head (1, 0): from position 20 on, 70% of every row goes to key 20.
    rows = np.arange(21, n)
    a[1, 0, rows] *= 0.3
    a[1, 0, rows, 20] += 0.7
    sm = sink_map(a)
    assert sm.flags[1, 0, 20]
    assert 20 in sm.mid_sequence
    assert sm.head_counts[20] == 1
    assert not sm.flags[0].any()  # diffuse heads have no sink
    np.testing.assert_allclose(sm.mean_received[:-1], sm.received[..., :-1].mean(axis=(0, 1)))
    assert np.isnan(sm.mean_received[-1])


def test_streaming_registered_as_a_head_metric():
    a = random_causal(np.random.default_rng(3), 2, 2, 80)
    metric = HEAD_METRICS["streaming"]
    np.testing.assert_allclose(metric.compute(a), streaming_score(a))


@pytest.mark.integration
def test_embedded_model_has_streaming_and_full_context_heads_and_a_first_token_sink():
    from analysis.capture import capture
    from analysis.models import load_model
    from analysis.niah import load_haystack

    model = load_model("smollm2-135m")
    ids = model.encode(load_haystack("prose"))[:300]
    patterns = capture(model, ids).patterns
    s = streaming_score(patterns)
    assert s.max() > 0.95 and s.min() < 0.5  # measured: 0.37 .. 1.0, median 0.83
    sm = sink_map(patterns)
    assert sm.positions[0] == 0 and sm.head_counts[0] > 0.5 * s.size  # position 0 sinks most heads


def test_a_sink_needs_min_later_later_tokens():
    # A head that puts every query's whole attention on key 0: position 0 receives 1.0, but it is
    # only called a sink once 16 queries follow it (17 tokens), never in a 16-token text.
    for n, called in ((SINK_MIN_LATER, False), (SINK_MIN_LATER + 1, True)):
        a = np.zeros((1, 1, n, n))
        a[..., 0] = 1.0
        sm = sink_map(a)
        assert sm.received[0, 0, 0] == 1.0
        assert bool(sm.flags[0, 0, 0]) is called
        assert (sink_checked_positions(n) > 0) is called
    assert sink_checked_positions(40) == 40 - SINK_MIN_LATER  # positions 0 .. 23 have 16+ later tokens
    assert sink_checked_positions(3, min_later=1) == 2
