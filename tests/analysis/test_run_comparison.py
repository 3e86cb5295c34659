"""Two runs compared head by head: changes checked against the score's definition worked by hand, and
every pair of runs that does not correspond position by position or head by head refused with a message."""

from __future__ import annotations

import numpy as np
import pytest

from headscope.analysis.capture import Run
from headscope.analysis.errors import InputError
from headscope.analysis.run_comparison import (
    ONE_TEXT,
    SAME_RUN,
    TWO_MODELS,
    TWO_PROMPTS,
    attention_difference,
    compare_runs,
)


def causal_patterns(rng, n_layers=3, n_heads=4, n=7) -> np.ndarray:
    logits = rng.normal(size=(n_layers, n_heads, n, n))
    logits[..., np.triu(np.ones((n, n), dtype=bool), 1)] = -np.inf
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def make_run(key, patterns, token_ids, digest="m1", name="tiny"):
    n = patterns.shape[-1]
    return Run(key=key, model_name=name, model_digest=digest, token_ids=list(token_ids),
               tokens=[f"t{i}" for i in token_ids], text=" ".join(map(str, token_ids)), settings={},
               patterns=patterns, token_loss=np.full(n, np.nan), top_ids=np.zeros((n, 5), int),
               top_probs=np.zeros((n, 5)))


def test_the_change_is_second_minus_first_of_the_score_worked_by_hand():
    rng = np.random.default_rng(0)
    a, b = causal_patterns(rng), causal_patterns(rng)
    first = make_run("a" * 64, a, [1, 2, 3, 4, 5, 6, 7])
    second = make_run("b" * 64, b, [1, 2, 3, 9, 5, 6, 7])
    result = compare_runs(first, second, "previous_token")
    # previous-token score: (1/(n−1)) Σ_{i=1}^{n−1} A[i, i−1], per head
    by_hand = lambda p: np.mean([p[..., i, i - 1] for i in range(1, 7)], axis=0)  # noqa: E731
    np.testing.assert_allclose(result.difference, by_hand(b) - by_hand(a), atol=1e-12)
    assert result.kind == TWO_PROMPTS and result.differ == (3,)
    top = result.largest_changes(3)
    flat = np.abs(by_hand(b) - by_hand(a)).ravel()
    assert [(c.layer, c.head) for c in top] == [divmod(int(i), 4) for i in np.argsort(-flat)[:3]]
    assert top[0].change == pytest.approx(top[0].second - top[0].first)
    diff = attention_difference(first, second, 2, 1)
    np.testing.assert_allclose(diff, (b[2, 1] - a[2, 1]).astype(np.float32), atol=1e-6)


def test_one_prompt_on_two_models_is_compared_and_a_run_with_itself_changes_nothing():
    rng = np.random.default_rng(1)
    ids = [5, 6, 7, 8, 9, 10, 11]
    first = make_run("a" * 64, causal_patterns(rng), ids, digest="base")
    second = make_run("c" * 64, causal_patterns(rng), ids, digest="tuned", name="tuned")
    assert compare_runs(first, second, "entropy").kind == TWO_MODELS
    same = compare_runs(first, first, "entropy")
    assert not np.any(same.difference) and same.differ == () and same.kind == SAME_RUN
    rerun = make_run("d" * 64, first.patterns, ids, digest="base")
    assert compare_runs(first, rerun, "entropy").kind == ONE_TEXT


@pytest.mark.parametrize("second_shape, second_ids, digest, message", [
    ((3, 4, 8), list(range(8)), "m1", "7 and 8 tokens"),
    ((2, 4, 7), list(range(7)), "m1", "differ in shape"),
    ((3, 4, 7), [0, 1, 2, 3, 4, 5, 99], "m2", "share a tokenizer"),
])
def test_runs_that_do_not_correspond_are_refused_with_the_reason(second_shape, second_ids, digest, message):
    rng = np.random.default_rng(2)
    first = make_run("a" * 64, causal_patterns(rng), range(7))
    L, H, n = second_shape
    second = make_run("b" * 64, causal_patterns(rng, L, H, n), second_ids, digest=digest)
    with pytest.raises(InputError, match=message):
        compare_runs(first, second, "entropy")
    with pytest.raises(InputError, match=message):
        attention_difference(first, second, 0, 0)


def test_an_unknown_metric_or_head_is_refused():
    rng = np.random.default_rng(3)
    first = make_run("a" * 64, causal_patterns(rng), range(7))
    second = make_run("b" * 64, causal_patterns(rng), range(7))
    with pytest.raises(InputError, match="cannot compute"):
        compare_runs(first, second, "no_such_score")
    with pytest.raises(InputError, match="layer"):
        attention_difference(first, second, 3, 0)


# --- the rounding of the stored patterns: how far a score can move from it (#38 item 18) ---

from headscope.analysis.score_registry import HEAD_METRICS  # noqa: E402


def _rounding_cases(seed=3, n=24):
    """The same attention as computed (float64, the 'true' weights) and as stored (float16), with
    peaked rows (weights near 1 and near 0, as real heads have) and token ids that repeat (the
    duplicate and induction scores need copies)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=4.0, size=(2, 3, n, n))
    logits[..., np.triu(np.ones((n, n), dtype=bool), 1)] = -np.inf
    e = np.exp(logits - logits.max(-1, keepdims=True))
    exact = e / e.sum(-1, keepdims=True)
    ids = [int(t) for t in rng.integers(0, 6, size=n)]
    return exact, exact.astype(np.float16), ids


def _within(exact, lo_hi_signs):
    """Weights moved inside their float16 rounding intervals: to one end (sign ±1) or anywhere."""
    stored = exact.astype(np.float16)
    spacing = np.spacing(np.abs(stored)).astype(np.float64) / 2
    moved = stored.astype(np.float64) + lo_hi_signs * spacing
    causal = np.tril(np.ones(exact.shape[-2:], dtype=bool))
    return np.where(causal, np.clip(moved, 0, None), 0.0)


@pytest.mark.parametrize("metric", sorted(HEAD_METRICS))
def test_a_score_moves_by_at_most_its_resolution_when_the_weights_move_within_their_rounding(metric):
    """For every score: the score of the weights as computed, and of weights anywhere inside each stored
    weight's rounding interval (random points and both ends), lies within ``score_resolution`` of the
    stored run's score; and the resolution is no wider than float16 can explain (a few units of
    2^-11, relative)."""
    from headscope.analysis.run_comparison import score_resolution

    exact, stored, ids = _rounding_cases()
    run = make_run("d" * 64, stored, ids)
    resolution = score_resolution(run, metric)
    score = run.head_scores(metric)
    assert resolution.shape == score.shape and np.all(np.isfinite(resolution) | np.isnan(score))
    rng = np.random.default_rng(7)
    worst = np.zeros_like(resolution)
    for signs in [np.ones(exact.shape), -np.ones(exact.shape), *(rng.uniform(-1, 1, exact.shape) for _ in range(6)),
                  *(rng.choice([-1.0, 1.0], exact.shape) for _ in range(6))]:
        moved = HEAD_METRICS[metric].compute(_within(exact, signs), ids, None)
        worst = np.fmax(worst, np.abs(moved - score))
    truth = HEAD_METRICS[metric].compute(exact, ids, None)
    worst = np.fmax(worst, np.abs(truth - score))
    finite = np.isfinite(score)
    assert np.all(worst[finite] <= resolution[finite] * (1 + 1e-9) + 1e-15), (metric, (worst - resolution).max())
    # not vacuous: at most a few float16 units of the score (plus the entropy's log terms)
    assert np.all(resolution[finite] <= 2.0**-11 * (8 + 8 * np.abs(score[finite]))), (metric, resolution.max())


def test_a_linear_score_reaches_its_resolution_exactly():
    """The previous-token score is a mean of weights: moving each to the top of its rounding interval
    moves the score by exactly the resolution (the bound is tight, not a guess)."""
    from headscope.analysis.run_comparison import score_resolution

    exact, stored, ids = _rounding_cases(seed=5)
    run = make_run("e" * 64, stored, ids)
    top = HEAD_METRICS["previous_token"].compute(_within(exact, np.ones(exact.shape)), ids, None)
    np.testing.assert_allclose(top - run.head_scores("previous_token"), score_resolution(run, "previous_token"),
                               rtol=1e-9, atol=1e-15)


def test_changes_within_the_rounding_of_both_runs_are_named():
    """The comparison's resolution is the sum of both runs' (each may be off by its own); a head whose
    change is within it is named as such, and a float16 run's change that flips sign between the
    stored and the exact weights is always among them."""
    from headscope.analysis.run_comparison import score_resolution

    rng = np.random.default_rng(11)
    exact_a = causal_patterns(rng, n=16)
    scale = np.logspace(-6, -2, exact_a.shape[0] * exact_a.shape[1]).reshape(exact_a.shape[:2] + (1, 1))
    noise = rng.normal(size=exact_a.shape) * scale * np.tril(np.ones((16, 16)))  # from far below float16 to far above
    exact_b = np.clip(exact_a + noise, 0, None)
    exact_b /= exact_b.sum(-1, keepdims=True)
    ids = list(range(16))
    first, second = make_run("a" * 64, exact_a.astype(np.float16), ids), make_run("b" * 64, exact_b.astype(np.float16), ids)
    for metric in ("entropy", "previous_token", "first_token"):
        result = compare_runs(first, second, metric)
        np.testing.assert_allclose(result.resolution, score_resolution(first, metric) + score_resolution(second, metric))
        within = result.within_rounding
        assert within.dtype == bool and within.shape == result.difference.shape
        np.testing.assert_array_equal(within, np.abs(result.difference) <= result.resolution)
        exact_change = HEAD_METRICS[metric].compute(exact_b, ids, None) - HEAD_METRICS[metric].compute(exact_a, ids, None)
        flipped = np.sign(exact_change) * np.sign(result.difference) < 0
        assert not np.any(flipped & ~within), metric
        assert 0 < within.sum() < within.size, (metric, int(within.sum()))
        assert result.stored == "float16 patterns"


def test_statistics_and_float32_runs_carry_float32_precision():
    """A float32 run's resolution is float32's (about 1e-7 of a score): its changes print to 4 decimals."""
    from headscope.analysis.run_comparison import score_resolution, shown_decimals

    exact, _, ids = _rounding_cases(seed=2)
    run = make_run("f" * 64, exact.astype(np.float32), ids)
    for metric in HEAD_METRICS:
        resolution = score_resolution(run, metric)
        assert np.all(np.isnan(resolution) | (resolution < 1e-5)), metric
    assert shown_decimals(np.array([1e-7, 2.4e-4, 4.9e-4, 0.002, 0.3])).tolist() == [4, 3, 3, 2, 1]
