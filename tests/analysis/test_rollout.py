"""Attention rollout (Abnar & Zuidema 2020) against hand-computed numbers and its invariants."""

import numpy as np
import pytest

from headscope.analysis.rollout import augmented_attention, rollout, rollout_per_layer

# Two layers, two heads, three tokens; rows are post-softmax and causal.
LAYER1 = [
    [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.2, 0.6]],
    [[1.0, 0.0, 0.0], [0.1, 0.9, 0.0], [0.4, 0.4, 0.2]],
]
LAYER2 = [
    [[1.0, 0.0, 0.0], [0.8, 0.2, 0.0], [0.5, 0.3, 0.2]],
    [[1.0, 0.0, 0.0], [0.4, 0.6, 0.0], [0.1, 0.1, 0.8]],
]
PATTERNS = np.array([LAYER1, LAYER2])  # [layer=2, head=2, query=3, key=3]

# By hand, residual 0.5, mean fusion:
#   mean layer 1 = [[1, 0, 0], [.3, .7, 0], [.3, .3, .4]]  ->  Â_1 = .5·mean + .5·I
#   mean layer 2 = [[1, 0, 0], [.6, .4, 0], [.3, .2, .5]]  ->  Â_2
A1 = np.array([[1.0, 0.0, 0.0], [0.15, 0.85, 0.0], [0.15, 0.15, 0.70]])
A2 = np.array([[1.0, 0.0, 0.0], [0.30, 0.70, 0.0], [0.15, 0.10, 0.75]])
#   Â_2·Â_1, row 1: .3·[1,0,0] + .7·[.15,.85,0]                     = [.405, .595, 0]
#            row 2: .15·[1,0,0] + .1·[.15,.85,0] + .75·[.15,.15,.7] = [.2775, .1975, .525]
ROLLOUT = np.array([[1.0, 0.0, 0.0], [0.405, 0.595, 0.0], [0.2775, 0.1975, 0.525]])


def random_causal(rng, n_layers, n_heads, n, alpha=1.0):
    a = np.zeros((n_layers, n_heads, n, n))
    for i in range(n):
        a[:, :, i, : i + 1] = rng.dirichlet(np.full(i + 1, alpha), size=(n_layers, n_heads))
    return a


def test_rollout_matches_hand_computed_example():
    np.testing.assert_allclose(augmented_attention(PATTERNS), np.stack([A1, A2]), atol=1e-15)
    np.testing.assert_allclose(rollout(PATTERNS), ROLLOUT, atol=1e-15)


def test_rollout_per_layer_is_cumulative():
    per_layer = rollout_per_layer(PATTERNS)
    assert per_layer.shape == (2, 3, 3)
    np.testing.assert_allclose(per_layer[0], A1, atol=1e-15)
    np.testing.assert_allclose(per_layer[1], ROLLOUT, atol=1e-15)


def test_layer_range_selects_the_product():
    np.testing.assert_allclose(rollout(PATTERNS, start_layer=1), A2, atol=1e-15)
    np.testing.assert_allclose(rollout(PATTERNS, end_layer=1), A1, atol=1e-15)


def test_max_fusion_renormalises_before_adding_identity():
    # max layer 1 = [[1,0,0], [.5,.9,0], [.4,.4,.6]]; rows / sum -> [5/14, 9/14], [2/7, 2/7, 3/7]
    expected = np.array([[1.0, 0, 0], [5 / 28, 23 / 28, 0], [1 / 7, 1 / 7, 5 / 7]])
    np.testing.assert_allclose(rollout(PATTERNS, fusion="max", end_layer=1), expected, atol=1e-15)


def test_min_fusion():
    # min layer 1 = [[1,0,0], [.1,.5,0], [.2,.2,.2]]; rows / sum -> [1/6, 5/6], [1/3, 1/3, 1/3]
    expected = np.array([[1.0, 0, 0], [1 / 12, 11 / 12, 0], [1 / 6, 1 / 6, 2 / 3]])
    np.testing.assert_allclose(rollout(PATTERNS, fusion="min", end_layer=1), expected, atol=1e-15)


def test_sink_removal_renormalises_the_rest():
    # mean layer 1 without key 0: row 0 empty -> keeps itself; row 1 [0, .7] -> [0, 1];
    # row 2 [0, .3, .4] -> [0, 3/7, 4/7]; then .5·that + .5·I.
    expected = np.array([[1.0, 0, 0], [0, 1.0, 0], [0, 3 / 14, 11 / 14]])
    got = rollout(PATTERNS, drop_sinks=(0,), end_layer=1)
    np.testing.assert_allclose(got, expected, atol=1e-15)
    full = rollout(random_causal(np.random.default_rng(3), 4, 3, 10), drop_sinks=[0, 4])
    np.testing.assert_allclose(full.sum(axis=1), 1.0, atol=1e-12)
    assert np.all(full[1:, 0] == 0) and np.all(full[5:, 4] == 0)


def test_discard_drops_lowest_off_diagonal_entries_per_row():
    # One head, residual 0: Â is the renormalised, discarded attention itself.
    a = np.array(
        [
            [1.0, 0, 0, 0],
            [0.6, 0.4, 0, 0],
            [0.5, 0.2, 0.3, 0],
            [0.1, 0.4, 0.2, 0.3],
        ]
    )[None, None]
    # Row i keeps floor(.5·(i+1)) fewer entries, never the diagonal:
    # row 1 drops .6; row 2 drops .2; row 3 drops .1 and .2.
    expected = np.array(
        [
            [1.0, 0, 0, 0],
            [0, 1.0, 0, 0],
            [5 / 8, 0, 3 / 8, 0],
            [0, 4 / 7, 0, 3 / 7],
        ]
    )
    np.testing.assert_allclose(rollout(a, residual=0.0, discard_ratio=0.5), expected, atol=1e-15)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("options", [{}, {"discard_ratio": 0.4}, {"drop_sinks": (0,), "residual": 0.2}])
def test_rows_sum_to_one_and_stay_causal(fusion, options):
    patterns = random_causal(np.random.default_rng(0), 6, 4, 12, alpha=0.3)
    per_layer = rollout_per_layer(patterns, fusion=fusion, **options)
    np.testing.assert_allclose(per_layer.sum(axis=-1), 1.0, atol=1e-12)
    assert np.all(np.triu(per_layer, k=1) == 0)
    assert np.all(per_layer >= 0)


def test_float16_input_is_computed_in_float64():
    patterns = random_causal(np.random.default_rng(1), 3, 2, 8).astype(np.float16)
    got = rollout(patterns)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, rollout(patterns.astype(np.float64)), atol=1e-15)


def test_residual_extremes():
    patterns = random_causal(np.random.default_rng(2), 1, 1, 6)
    np.testing.assert_allclose(rollout(patterns, residual=1.0), np.eye(6), atol=1e-15)
    np.testing.assert_allclose(rollout(patterns, residual=0.0), patterns[0, 0], atol=1e-15)


def test_progress_reaches_one():
    seen = []
    rollout(PATTERNS, progress=seen.append)
    assert seen == sorted(seen) and seen[-1] == 1.0


@pytest.mark.parametrize(
    ("patterns", "options", "message"),
    [
        (PATTERNS[0], {}, "4 dimensions"),
        (PATTERNS[:, :, :2, :], {}, "square"),
        (PATTERNS, {"fusion": "median"}, "fusion must be one of"),
        (PATTERNS, {"discard_ratio": 1.0}, "discard_ratio"),
        (PATTERNS, {"residual": 1.5}, "residual"),
        (PATTERNS, {"drop_sinks": (3,)}, "outside the sequence"),
        (PATTERNS, {"start_layer": 2}, "start_layer"),
        (PATTERNS, {"start_layer": 1, "end_layer": 1}, "end_layer"),
        (PATTERNS, {"end_layer": 3}, "end_layer"),
        (np.swapaxes(PATTERNS, -1, -2), {}, "causal"),
        (np.where(PATTERNS == 1.0, np.nan, PATTERNS), {}, "NaN"),
        (-PATTERNS, {}, "negative"),
        (PATTERNS.astype(int), {}, "float"),
    ],
)
def test_invalid_input_says_what_is_wrong(patterns, options, message):
    with pytest.raises(ValueError, match=message):
        rollout(patterns, **options)
