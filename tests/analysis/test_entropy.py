import numpy as np

from headscope.analysis.entropy import normalised_entropy


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


def test_row_entropy_matches_the_definition_row_by_row_across_chunks():
    """Row entropies against ``-Σ p log p`` over the row's nonzero weights in plain Python floats, on a random causal pattern of 150 tokens (three
    64-row chunks, exact zeros inside the triangle too), read causally (each chunk reads only the
    keys up to its last row) and in full; and on a non-causal, non-square one."""
    import math

    from headscope.analysis.entropy import row_entropy

    def entropy(row) -> float:
        return -math.fsum(float(p) * math.log(float(p)) for p in row if p > 0)

    rng = np.random.default_rng(0)
    n = 150
    logits = np.where(np.tril(np.ones((n, n), dtype=bool)), rng.standard_normal((2, n, n)) * 3, -np.inf)
    logits[0, 100:, 7] = -np.inf
    a = np.exp(logits - logits.max(-1, keepdims=True))
    a = (a / a.sum(-1, keepdims=True)).astype(np.float32)
    expected = np.array([[entropy(row.astype(np.float64)) for row in head] for head in a])
    np.testing.assert_allclose(row_entropy(a, causal=True), expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(row_entropy(a), expected, rtol=1e-12, atol=1e-14)
    b = rng.dirichlet(np.ones(70), size=(3, 130))
    np.testing.assert_allclose(row_entropy(b), [[entropy(row) for row in head] for head in b], rtol=1e-12)
    # float16, as a stored run keeps its patterns (read through a table of p·log p per float16 value)
    h = a.astype(np.float16)
    expected = np.array([[entropy(row.astype(np.float64)) for row in head] for head in h])
    np.testing.assert_allclose(row_entropy(h, causal=True), expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(row_entropy(h[:, 3:90, 5:140]), [[entropy(row.astype(np.float64)) for row in head]
                                                               for head in h[:, 3:90, 5:140]], rtol=1e-12, atol=1e-14)
    assert np.isnan(row_entropy(np.array([[np.nan, 0.5]], dtype=np.float16))[0])  # as the float64 path gives


def test_a_whole_runs_rows_on_one_or_two_threads_are_the_one_call_results_bit_for_bit():
    """``[layer, head, n, n]`` patterns are taken a layer at a time, the layers shared among torch's
    threads: on one thread and on two the result is bit for bit that of one call over every head at
    once (the path a ``[head, n, n]`` array still takes, as the whole run took before), over three
    64-row chunks, and the definition row by row (float16 and float32)."""
    import math

    import torch

    from headscope.analysis.entropy import row_entropy

    rng = np.random.default_rng(1)
    L, H, n = 5, 3, 150
    logits = np.where(np.tril(np.ones((n, n), dtype=bool)), rng.standard_normal((L, H, n, n)) * 3, -np.inf)
    a = np.exp(logits - logits.max(-1, keepdims=True))
    a = (a / a.sum(-1, keepdims=True)).astype(np.float32)
    threads = torch.get_num_threads()
    try:
        for patterns in (a, a.astype(np.float16)):
            at_once = row_entropy(patterns.reshape(L * H, n, n), causal=True).reshape(L, H, n)
            for count in (1, 2):
                torch.set_num_threads(count)
                assert np.array_equal(row_entropy(patterns, causal=True), at_once)
            expected = [[[-math.fsum(float(p) * math.log(float(p)) for p in row if p > 0) for row in head]
                         for head in layer] for layer in patterns[:2]]
            np.testing.assert_allclose(at_once[:2], expected, rtol=1e-12, atol=1e-14)
    finally:
        torch.set_num_threads(threads)
