"""Position-corrected rollout and flow, checked by hand and against networkx."""

from __future__ import annotations

import numpy as np
import pytest

from headscope.analysis.attribution import token_relevance
from headscope.analysis.flow import flow_reference_networkx
from headscope.analysis.position_bias import position_corrected, uniform_baseline, uniform_causal_patterns


def random_causal(n_layers: int, n_heads: int, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n_layers, n_heads, n, n)) * 2
    logits[..., np.triu(np.ones((n, n), dtype=bool), k=1)] = -np.inf
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_uniform_causal_attention_spreads_each_query_evenly_over_what_it_sees():
    u = uniform_causal_patterns(3, 4)
    assert u.shape == (3, 1, 4, 4)
    assert np.allclose(u[0, 0, 2], [1 / 3, 1 / 3, 1 / 3, 0])
    assert np.allclose(u.sum(-1), 1)


def test_rollout_baseline_is_the_product_of_uniform_steps_worked_by_hand():
    n, layers, r = 5, 4, 0.5
    u = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
    step = r * np.eye(n) + (1 - r) * u
    by_hand = np.linalg.matrix_power(step, layers)[n - 1]
    assert np.allclose(uniform_baseline("rollout", layers, n - 1, residual=r), by_hand)
    # The bias the correction removes: under uniform attention rollout still falls with position.
    assert np.all(np.diff(by_hand[:-1]) < 0)


def test_flow_baseline_equals_networkx_max_flow_on_uniform_attention():
    u = uniform_causal_patterns(3, 6)
    ours = uniform_baseline("flow", 3, 5, residual=0.5)
    assert np.allclose(ours, flow_reference_networkx(np.ascontiguousarray(u), target=5), atol=1e-9)
    assert ours[0] > ours[3]  # earlier inputs have more paths: the positional head start


def test_attention_that_is_uniform_gets_a_flat_corrected_row_while_the_plain_row_slopes():
    patterns = np.repeat(uniform_causal_patterns(4, 7), 3, axis=1)  # three identical heads
    rel = token_relevance(patterns, 6, corrected=True)
    assert rel.scores["rollout"][0] > 2 * rel.scores["rollout"][5]
    for name in ("rollout_debiased", "flow_debiased"):
        assert np.allclose(rel.scores[name], 1 / 7), name


def test_corrected_scores_are_the_ratio_to_the_uniform_baseline_normalised():
    patterns = random_causal(3, 2, 8, seed=1)
    rel = token_relevance(patterns, 7, corrected=True, residual=0.3)
    for plain in ("rollout", "flow"):
        ratio = rel.scores[plain] / uniform_baseline(plain, 3, 7, residual=0.3)
        assert np.allclose(rel.scores[f"{plain}_debiased"], ratio / ratio.sum())
    assert "rollout_debiased" not in token_relevance(patterns, 7).scores  # only when asked


def test_a_dropped_sink_gets_zero_and_the_rest_sums_to_one():
    patterns = random_causal(2, 2, 6, seed=2)
    rel = token_relevance(patterns, 5, corrected=True, drop_sinks=(0,))
    for name in ("rollout_debiased", "flow_debiased"):
        assert rel.scores[name][0] == 0 and np.isclose(rel.scores[name].sum(), 1)


def test_flow_past_its_limit_has_no_corrected_flow_but_keeps_corrected_rollout():
    patterns = random_causal(2, 1, 6, seed=3)
    rel = token_relevance(patterns, 5, corrected=True, flow_limit=4)
    assert "flow" in rel.unavailable and "flow_debiased" not in rel.scores
    assert rel.unavailable["flow_debiased"] == rel.unavailable["flow"]  # said why, not left out in silence
    assert "rollout_debiased" in rel.scores


def test_baseline_is_read_only_and_options_are_checked():
    base = uniform_baseline("rollout", 2, 3)
    with pytest.raises(ValueError):
        base[0] = 1.0
    with pytest.raises(ValueError, match="baseline"):
        uniform_baseline("attention", 2, 3)
    with pytest.raises(ValueError, match="shape"):
        position_corrected(np.ones(3), np.ones(4))


def test_one_strong_path_is_what_the_corrected_maps_point_to():
    """Every query from position 2 on attends only to token 2 (earlier queries to themselves): the
    corrected maps keep exactly that path (token 2, the largest, and the target through the residual)
    and give nothing to tokens no path reaches."""
    n, layers = 7, 3
    a = np.zeros((n, n))
    for i in range(n):
        a[i, 2 if i >= 2 else i] = 1.0
    patterns = np.broadcast_to(a, (layers, 2, n, n)).copy()
    rel = token_relevance(patterns, n - 1, corrected=True)
    for name in ("rollout_debiased", "flow_debiased"):
        scores = rel.scores[name]
        assert int(np.argmax(scores)) == 2, (name, scores)
        assert set(np.flatnonzero(scores > 1e-12)) == {2, n - 1}, (name, scores)
