"""Head detectors against hand-computed patterns and TransformerLens' own ``detect_head``; run and
key-value-group aggregation by hand."""

import numpy as np
import pytest

from headscope.analysis.capture import capture
from headscope.analysis.detectors import (
    aggregate_runs,
    detection_pattern,
    detector_scores,
    expand_groups,
    group_heads,
    head_detector_scores,
)


def one_hot_rows(n, targets):
    """A [n, n] causal pattern whose row i puts all its attention on key targets[i]."""
    a = np.zeros((n, n))
    for i, j in enumerate(targets):
        a[i, j] = 1.0
    return a


def test_detection_patterns_by_hand():
    ids = [7, 8, 9, 7, 8]
    np.testing.assert_array_equal(detection_pattern("previous_token", ids).numpy(), np.eye(5, k=-1))
    dup = np.zeros((5, 5))
    dup[3, 0] = dup[4, 1] = 1  # token 7 at 3 repeats 0, token 8 at 4 repeats 1
    np.testing.assert_array_equal(detection_pattern("duplicate_token", ids).numpy(), dup)
    ind = np.zeros((5, 5))
    ind[3, 1] = ind[4, 2] = 1  # the token after the earlier copy
    np.testing.assert_array_equal(detection_pattern("induction", ids).numpy(), ind)
    with pytest.raises(ValueError, match="kind"):
        detection_pattern("copy", ids)


def test_scores_by_hand():
    ids = [7, 8, 9, 7, 8, 9]
    prev = one_hot_rows(6, [0, 0, 1, 2, 3, 4])  # row 0 can only see itself
    induction = one_hot_rows(6, [0, 0, 0, 1, 2, 3])
    sink = one_hot_rows(6, [0] * 6)
    patterns = np.stack([prev, induction, sink])[None]  # [1 layer, 3 heads, 6, 6]
    # mul: Σ A·D / Σ A with Σ A = 6 rows
    np.testing.assert_allclose(head_detector_scores(patterns, ids, "previous_token"), [[5 / 6, 1 / 6, 1 / 6]])
    np.testing.assert_allclose(head_detector_scores(patterns, ids, "induction"), [[0, 3 / 6, 0]])
    # duplicate: only the sink head's row 3 (token 7 -> key 0, the earlier 7) lands on the pattern
    np.testing.assert_allclose(head_detector_scores(patterns, ids, "duplicate_token"), [[0, 0, 1 / 6]])
    # exclude_bos drops key 0 from both sums: previous-token head 4/4 (row 0 and row 1 only saw key 0);
    # induction head 0/3 (rows 3-5 on keys 1-3, never i-1)
    excl = head_detector_scores(patterns[:, :2], ids, "previous_token", exclude_bos=True)
    np.testing.assert_allclose(excl, [[1.0, 0.0]])
    # abs: 1 - round(N * mean |A - D|, 3) = 1 - Σ|A - D| / N ; induction head vs induction pattern:
    # rows 0-2 put 1 where D is 0 -> Σ|A - D| = 3 -> 1 - 3/6
    np.testing.assert_allclose(
        head_detector_scores(patterns, ids, "induction", error_measure="abs")[0, 1], 0.5
    )


def test_bad_inputs():
    p = np.tile(np.eye(3), (1, 1, 1, 1))
    with pytest.raises(ValueError, match="3 positions"):
        head_detector_scores(p, [1, 2], "induction")
    with pytest.raises(ValueError, match="error_measure"):
        head_detector_scores(p, [1, 2, 3], "induction", error_measure="l2")
    with pytest.raises(ValueError, match="N, N"):
        head_detector_scores(p[0], [1, 2, 3], "induction")


@pytest.fixture(scope="module")
def tiny(make_tiny_model):
    return make_tiny_model(seed=1, max_positions=2048, name="tiny-detectors")


@pytest.mark.parametrize("measure", ["mul", "abs"])
@pytest.mark.parametrize("exclude", [False, True])
def test_equals_transformer_lens_detect_head(tiny, measure, exclude):
    from transformer_lens.head_detector import detect_head

    text = "the cat sat on the mat and the cat sat on the mat again"
    ids = tiny.bridge.to_tokens(text)[0].tolist()  # detect_head prepends a BOS: use the same ids
    run = capture(tiny, ids, pattern_dtype="float32")
    ours = detector_scores(run.patterns, ids, error_measure=measure) if not exclude else None
    for kind, name in [
        ("previous_token", "previous_token_head"),
        ("duplicate_token", "duplicate_token_head"),
        ("induction", "induction_head"),
    ]:
        kw = {"exclude_bos": exclude, "exclude_current_token": exclude, "error_measure": measure}
        ref = detect_head(tiny.bridge, text, name, **kw).numpy()
        got = head_detector_scores(run.patterns, ids, kind, **kw) if exclude else ours[kind]
        # "abs" rounds to 3 decimals, so float rounding can flip the last place
        np.testing.assert_allclose(got, ref, atol=2e-3 if measure == "abs" else 1e-5)


def test_aggregate_runs_by_hand():
    a = np.array([[0.1, 0.5]])
    b = np.array([[0.3, np.nan]])
    c = np.array([[0.5, 0.7]])
    agg = aggregate_runs([a, b, c])
    np.testing.assert_allclose(agg.mean, [[0.3, 0.6]])
    np.testing.assert_allclose(agg.std, [[0.2, np.sqrt(0.02)]])  # ddof=1
    np.testing.assert_allclose(agg.sem, [[0.2 / np.sqrt(3), np.sqrt(0.02) / np.sqrt(2)]])
    np.testing.assert_array_equal(agg.n, [[3, 2]])
    np.testing.assert_allclose(agg.minimum, [[0.1, 0.5]])
    np.testing.assert_allclose(agg.maximum, [[0.5, 0.7]])
    single = aggregate_runs([a])
    np.testing.assert_array_equal(single.std, [[0.0, 0.0]])
    with pytest.raises(ValueError):
        aggregate_runs([])


def test_group_heads_by_hand():
    # 6 query heads, 2 key-value heads: heads 0-2 read kv 0, heads 3-5 read kv 1.
    s = np.array([[0.1, 0.5, 0.3, 0.9, np.nan, 0.1], [np.nan, np.nan, np.nan, 0.0, 0.2, 0.4]])
    np.testing.assert_allclose(group_heads(s, 2, "max"), [[0.5, 0.9], [np.nan, 0.4]])
    np.testing.assert_allclose(group_heads(s, 2, "mean"), [[0.3, 0.5], [np.nan, 0.2]])
    np.testing.assert_allclose(group_heads(s, 2, "min"), [[0.1, 0.1], [np.nan, 0.0]])
    np.testing.assert_allclose(group_heads(s, 6, "max"), s)  # no sharing: identity
    np.testing.assert_allclose(expand_groups([[1.0, 2.0]], 6), [[1, 1, 1, 2, 2, 2]])
    with pytest.raises(ValueError, match="cannot be split"):
        group_heads(s, 4)


@pytest.mark.integration
def test_embedded_model_has_induction_and_previous_token_heads():
    from headscope.analysis.models import load_model

    model = load_model("smollm2-135m")
    half = np.random.default_rng(0).integers(1000, 20000, size=60).tolist()
    ids = [1] + half + half  # random tokens repeated once: only induction can predict the second half
    scores = detector_scores(capture(model, ids).patterns, ids)
    # a perfect induction head scores 60/121 here (the first half has nothing to copy)
    assert scores["induction"].max() > 0.3
    assert scores["previous_token"].max() > 0.7
    top = np.unravel_index(scores["induction"].argmax(), scores["induction"].shape)
    assert top[0] >= 2  # induction needs a previous-token head in an earlier layer
