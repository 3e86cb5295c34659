import numpy as np

from analysis.head_summary import HEAD_METRICS, first_token_mass, max_attention, previous_token_mass


def test_previous_token_head_scores_one_and_sink_head_scores_one_on_first_token():
    n = 5
    prev = np.zeros((n, n))
    prev[0, 0] = 1
    prev[np.arange(1, n), np.arange(n - 1)] = 1
    sink = np.zeros((n, n))
    sink[:, 0] = 1
    p = np.stack([prev, sink])[None]
    np.testing.assert_allclose(previous_token_mass(p), [[1.0, 0.25]])  # row 1's previous token is 0
    np.testing.assert_allclose(first_token_mass(p), [[0.25, 1.0]])
    np.testing.assert_allclose(max_attention(p), [[1.0, 1.0]])


def test_every_metric_gives_layer_by_head():
    rng = np.random.default_rng(0)
    p = np.tril(rng.random((3, 2, 7, 7)))
    p /= p.sum(-1, keepdims=True)
    for metric in HEAD_METRICS.values():
        assert metric.compute(p).shape == (3, 2), metric.name
