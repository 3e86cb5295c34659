import numpy as np

from analysis.entropy import normalised_entropy


def causal_uniform(n):
    a = np.tril(np.ones((n, n)))
    return a / a.sum(-1, keepdims=True)


def test_uniform_is_one_and_one_hot_is_zero():
    n = 6
    uniform = causal_uniform(n)
    first = np.zeros((n, n))
    first[:, 0] = 1.0
    scores = normalised_entropy(np.stack([uniform, first])[None])
    np.testing.assert_allclose(scores, [[1.0, 0.0]], atol=1e-12)


def test_hand_computed_three_tokens():
    # row 1 = [0.5, 0.5]: H = log 2, normalised 1; row 2 = [0.5, 0.25, 0.25]: H = 1.5 log 2 / log 3
    a = np.array([[1, 0, 0], [0.5, 0.5, 0], [0.5, 0.25, 0.25]])
    expected = (1.0 + 1.5 * np.log(2) / np.log(3)) / 2
    np.testing.assert_allclose(normalised_entropy(a[None, None]), [[expected]], rtol=1e-12)


def test_single_token_has_no_entropy():
    assert np.isnan(normalised_entropy(np.ones((1, 2, 1, 1)))).all()
