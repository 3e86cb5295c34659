"""Streaming score and sink map against hand-computed patterns and a brute-force loop."""

import numpy as np
import pytest

from headscope.analysis.score_registry import HEAD_METRICS
from headscope.analysis.streaming import SINK_MIN_LATER, sink_checked_positions, sink_map, streaming_score


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
    from headscope.analysis.capture import capture
    from headscope.analysis.models import load_model
    from headscope.analysis.niah import load_haystack

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


# --- layers with a sliding window set by the model ---------------------------------------------------


def random_windowed(rng, n, windows, n_heads=2):
    """Random causal rows that, on a layer with window w, spread only over keys i - w < j <= i."""
    a = np.zeros((len(windows), n_heads, n, n))
    for layer, w in enumerate(windows):
        for i in range(n):
            lo = max(0, i - w + 1) if w else 0
            a[layer, :, i, lo : i + 1] = rng.dirichlet(np.ones(i + 1 - lo), size=n_heads)
    return a


def brute_windowed_streaming(a, sink, window, windows):
    """Mean sink + recent mass over the rows i >= S + W whose query sees every key 0..i (i < W_model)."""
    n = a.shape[-1]
    out = np.full(a.shape[:2], np.nan)
    for layer in range(a.shape[0]):
        w_model = windows[layer] or n + 1
        rows = [i for i in range(sink + window, n) if i < w_model]
        for head in range(a.shape[1]):
            if rows:
                keys = lambda i: set(range(sink)) | set(range(i - window + 1, i + 1))  # noqa: E731
                out[layer, head] = np.mean([sum(a[layer, head, i, j] for j in keys(i)) for i in rows])
    return out


def brute_windowed_received(a, windows):
    """Per key: mean attention from the strictly later queries that can see it (i - W_model < j)."""
    n = a.shape[-1]
    out = np.full(a.shape[:3], np.nan)
    for layer in range(a.shape[0]):
        w_model = windows[layer] or n + 1
        for j in range(n):
            queries = [i for i in range(j + 1, n) if i - w_model < j]
            if queries:
                out[layer, :, j] = a[layer, :, queries, j].mean(0)
    return out


def test_windowed_layers_are_scored_only_where_the_model_window_does_not_bind():
    """Layer 0 has a model window of 6 keys, layer 1 full attention. The streaming score of layer 0
    reads rows S + W <= i < 6 only, the sink map averages each key over the queries that can see it,
    and a layer whose window binds before row S + W has no streaming score (nan)."""
    rng = np.random.default_rng(5)
    windows = [6, None]
    a = random_windowed(rng, 30, windows)
    np.testing.assert_allclose(streaming_score(a, 1, 2, layer_windows=windows),
                               brute_windowed_streaming(a, 1, 2, windows), atol=1e-12)
    # the unwindowed definition counts rows 6.. of layer 0, where key 0 is out of reach: not the same
    assert not np.allclose(streaming_score(a, 1, 2)[0], brute_windowed_streaming(a, 1, 2, windows)[0])
    s = streaming_score(a, 2, 4, layer_windows=windows)  # S + W = 6: no row of layer 0 before the window binds
    assert np.isnan(s[0]).all() and np.isfinite(s[1]).all()
    sm = sink_map(a, threshold=0.3, min_later=3, layer_windows=windows)
    np.testing.assert_allclose(sm.received, brute_windowed_received(a, windows), atol=1e-12, equal_nan=True)
    # a key is checked when at least min_later queries can see it: on layer 0 at most 5 ever do
    assert not sink_map(a, threshold=0.01, min_later=6, layer_windows=windows).flags[0].any()
    assert sink_map(a, threshold=0.01, min_later=5, layer_windows=windows).flags[0, :, : 30 - 5].all()


def test_a_sink_on_a_windowed_layer_is_not_diluted_by_queries_that_cannot_see_it():
    """A head that puts half of every visible row on key 0: on a windowed layer, key 0 receives 0.5
    from each query that can see it; averaged over all later queries it would read 5/39 * 0.5."""
    n, w = 40, 6
    a = np.zeros((1, 1, n, n))
    for i in range(n):
        if i < w:
            a[0, 0, i, 0] += 0.5 if i else 1.0
            a[0, 0, i, i] += 0.5 if i else 0.0
        else:
            a[0, 0, i, i] = 1.0
    # the model window of 6 keys hides key 0 from queries 6..39; rows 1..5 give it 0.5 each
    sm = sink_map(a, min_later=5, layer_windows=[w])
    assert sm.received[0, 0, 0] == pytest.approx(0.5) and sm.flags[0, 0, 0]
    assert HEAD_METRICS["first_token"].compute(a, (), [w])[0, 0] == pytest.approx(0.5)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_streaming_and_sinks_of_tiny_windowed_models_equal_brute_force_from_eager_patterns(family, embedded_tokenizer):
    """Tiny Mistral (window 7 on every layer) and Gemma 3 (window 6 on layers 0 and 2): the streaming
    score, the attention received per key, the first-token share and the mid-sequence sink of a
    full-pattern run and of a statistics run equal brute force over the eager patterns."""
    from headscope.analysis.capture import capture
    from headscope.analysis.models import wrap_model
    from headscope.analysis.statistics_run import capture_statistics, statistics_score
    from tests.tiny_families import tiny_family_model

    model = wrap_model(tiny_family_model(family, len(embedded_tokenizer)), embedded_tokenizer,
                       name=f"tiny-{family}-streaming", digest=f"tiny-{family}-streaming")
    text = ("The keeper of the lighthouse wrote every evening in a small blue notebook. She counted the "
            "ships, the gulls and the storms, and once a year she sent the notebook to her sister.")
    ids = embedded_tokenizer.encode(text)[:40]
    run = capture(model, ids, pattern_dtype="float32", max_tokens=len(ids))
    windows = list(model.facts.windows)
    assert run.layer_windows == windows and any(windows)
    a = run.patterns.astype(np.float64)
    i, j = np.ogrid[: len(ids), : len(ids)]
    for layer, w in enumerate(windows):  # the brute force's window is the model's own mask
        if w:
            assert (a[layer][:, (j <= i - w) & (j <= i)] == 0).all()
    stats = capture_statistics(model, ids, sink=1, window=2)
    want = brute_windowed_streaming(a, 1, 2, windows)
    np.testing.assert_allclose(streaming_score(run.patterns, 1, 2, layer_windows=run.layer_windows), want, atol=1e-6)
    np.testing.assert_allclose(statistics_score(stats, "streaming"), want, atol=5e-6)
    received = brute_windowed_received(a, windows)
    np.testing.assert_allclose(run.received_attention(), received, atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(stats.received_attention(), received, atol=5e-6, equal_nan=True)
    np.testing.assert_allclose(run.head_scores("first_token"), received[..., 0], atol=1e-6)
    np.testing.assert_allclose(stats.head_scores("first_token"), received[..., 0], atol=5e-6)
    # a key needs SINK_MIN_LATER queries that can see it: a 6- or 7-key window never has them
    later = len(ids) - 1 - np.arange(len(ids))
    checked = np.stack([(np.minimum(later, w - 1) if w else later) >= SINK_MIN_LATER for w in windows])
    mid = np.where(checked[:, None, 1:], np.nan_to_num(received[..., 1:], nan=-1), -1).max(-1)
    mid = np.where(checked[:, 1:].any(-1)[:, None], mid, np.nan)
    np.testing.assert_allclose(run.head_scores("mid_sink"), mid, atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(stats.head_scores("mid_sink"), mid, atol=5e-6, equal_nan=True)
    assert np.isnan(mid[[la for la, w in enumerate(windows) if w]]).all()
