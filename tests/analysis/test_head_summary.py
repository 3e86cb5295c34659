import numpy as np
import pytest

from headscope.analysis.head_summary import (
    first_token_mass,
    max_attention,
    mid_sequence_sink,
    previous_token_mass,
)
from headscope.analysis.score_registry import HEAD_METRICS


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
    ids = [5, 6, 7, 5, 6, 7, 5]
    for metric in HEAD_METRICS.values():
        assert metric.compute(p, ids).shape == (3, 2), metric.name


def _rows(n, target):
    """A causal pattern whose row i puts all its weight on key target(i) (clipped to 0..i)."""
    a = np.zeros((n, n))
    for i in range(n):
        a[i, min(max(target(i), 0), i)] = 1.0
    return a


def test_induction_and_duplicate_heads_on_repeated_tokens_score_as_worked_by_hand():
    # tokens: a b c d a b c d; an induction head at i attends to the token after the earlier copy.
    ids = [1, 2, 3, 4, 1, 2, 3, 4]
    n = len(ids)
    induction = _rows(n, lambda i: i - 3 if i >= 4 else 0)  # i=4 (a) -> 1 (b, after the first a)
    duplicate = _rows(n, lambda i: i - 4 if i >= 4 else 0)  # i=4 (a) -> 0 (the earlier a)
    p = np.stack([induction, duplicate])[None]
    ind = HEAD_METRICS["induction"].compute(p, ids)
    dup = HEAD_METRICS["duplicate_token"].compute(p, ids)
    # mul score = attention on the detection pattern / total attention; rows 0..3 have no earlier
    # copy (their weight is wasted), rows 4..7 land exactly: 4 of 8 rows.
    np.testing.assert_allclose(ind[0], [0.5, 0.0])
    np.testing.assert_allclose(dup[0], [0.0, 0.5])


def test_mid_sequence_sink_finds_a_key_every_later_query_attends_to():
    n = 40
    to_five = _rows(n, lambda i: 5 if i > 5 else i)  # key 5 takes every later query's attention
    to_first = _rows(n, lambda i: 0)
    p = np.stack([to_five, to_first])[None]
    np.testing.assert_allclose(mid_sequence_sink(p), [[1.0, 0.0]])
    assert np.isnan(mid_sequence_sink(p[..., :10, :10])).all()  # too short for a mid-sequence sink


def test_previous_token_score_is_transformer_lens_detector_rescaled_by_n_over_n_minus_1():
    """The docstring's claim, against TransformerLens' own similarity score on random causal patterns."""
    import torch
    from transformer_lens.head_detector import compute_head_attention_similarity_score

    rng = np.random.default_rng(0)
    n = 11
    logits = rng.normal(size=(2, 3, n, n))
    logits[..., np.triu_indices(n, 1)[0], np.triu_indices(n, 1)[1]] = -np.inf
    patterns = np.exp(logits - logits.max(-1, keepdims=True))
    patterns /= patterns.sum(-1, keepdims=True)
    ours = previous_token_mass(patterns)
    detection = torch.zeros(n, n)
    detection[torch.arange(1, n), torch.arange(n - 1)] = 1
    for layer in range(2):
        for head in range(3):
            tl = compute_head_attention_similarity_score(
                torch.tensor(patterns[layer, head], dtype=torch.float64), detection.double(),
                exclude_bos=False, exclude_current_token=False, error_measure="mul")
            assert ours[layer, head] * (n - 1) / n == pytest.approx(tl, rel=1e-12)
