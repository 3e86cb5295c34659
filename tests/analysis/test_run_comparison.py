"""Two runs compared head by head: changes checked against the score's definition worked by hand, and
every pair of runs that does not correspond position by position or head by head refused with a message."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.capture import Run
from analysis.errors import InputError
from analysis.run_comparison import (
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
