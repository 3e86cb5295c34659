"""Evidence score and the cumulative-mass curve against hand-computed numbers and brute force."""

import numpy as np
import pytest

from headscope.analysis.evidence import cumulative_mass, evidence_score


def random_causal(rng, n_layers, n_heads, n):
    a = np.zeros((n_layers, n_heads, n, n))
    for i in range(n):
        a[:, :, i, : i + 1] = rng.dirichlet(np.ones(i + 1), size=(n_layers, n_heads))
    return a


def test_evidence_score_by_hand():
    # 5 tokens: evidence = positions 1-2, question = positions 3-4.
    a = np.zeros((1, 2, 5, 5))
    a[0, 0, 3, :4] = [0.1, 0.5, 0.2, 0.2]  # .7 on the evidence
    a[0, 0, 4, :5] = [0.2, 0.1, 0.2, 0.1, 0.4]  # .3 on the evidence
    a[0, 1, 3, :4] = [1.0, 0, 0, 0]
    a[0, 1, 4, :5] = [0, 0, 1.0, 0, 0]
    np.testing.assert_allclose(evidence_score(a, (3, 5), (1, 3)), [[0.5, 0.5]])
    # several evidence spans: {1} and {3}
    np.testing.assert_allclose(evidence_score(a, (3, 5), [(1, 2), (3, 4)]), [[(0.7 + 0.2) / 2, 0.0]])


def test_evidence_score_matches_brute_force():
    rng = np.random.default_rng(0)
    a = random_causal(rng, 2, 3, 12)
    q, e = (8, 12), [(2, 5), (6, 7)]
    expected = np.zeros((2, 3))
    for layer in range(2):
        for head in range(3):
            expected[layer, head] = np.mean(
                [sum(a[layer, head, i, j] for j in (2, 3, 4, 6)) for i in range(8, 12)]
            )
    np.testing.assert_allclose(evidence_score(a, q, e), expected, atol=1e-12)
    np.testing.assert_allclose(evidence_score(a.astype(np.float16), q, e), expected, atol=2e-3)


def test_evidence_spans_are_validated():
    a = random_causal(np.random.default_rng(1), 1, 1, 6)
    with pytest.raises(ValueError, match="question span"):
        evidence_score(a, (4, 9), (0, 2))
    with pytest.raises(ValueError, match="evidence span"):
        evidence_score(a, (4, 6), (3, 3))


def test_cumulative_mass_by_hand():
    # 8 heads, positive mass .4 + .3 + .2 + .1 = 1.0 ; top 1 holds .4, top 2 hold .7 >= .5
    scores = np.array([[0.1, 0.4, 0.0, -0.1], [np.nan, 0.2, 0.3, 0.0]])
    c = cumulative_mass(scores)
    np.testing.assert_array_equal(c.order, [1, 6, 5, 0])  # flat indices, best first
    np.testing.assert_allclose(c.mass_fraction, [0, 0.4, 0.7, 0.9, 1.0])
    np.testing.assert_allclose(c.head_fraction, [0, 1 / 8, 2 / 8, 3 / 8, 4 / 8])
    assert c.half_mass_heads == 2 and c.half_mass_fraction == 0.25
    assert cumulative_mass(scores, level=0.4).half_mass_heads == 1  # exactly .4 reaches .4
    assert cumulative_mass(scores, level=1.0).half_mass_heads == 4


def test_cumulative_mass_concentrated_vs_spread():
    concentrated = np.zeros((10, 10))
    concentrated[3, 3] = 5.0
    concentrated[0, :] = 0.01
    spread = np.ones((10, 10))
    assert cumulative_mass(concentrated).half_mass_fraction == 0.01  # 1 head of 100
    assert cumulative_mass(spread).half_mass_fraction == 0.5
    empty = cumulative_mass(-spread)
    assert np.isnan(empty.half_mass_fraction) and empty.half_mass_heads == 0


@pytest.mark.integration
def test_question_reads_the_needle_in_a_few_heads_of_the_embedded_model():
    from headscope.analysis.capture import capture
    from headscope.analysis.models import load_model
    from headscope.analysis.niah import build_prompt, load_haystack, load_needles

    model = load_model("smollm2-135m")
    needle = {n.id: n for n in load_needles()}["locker-code"]
    prompt = build_prompt(model, needle, load_haystack("prose"), 256, 50)
    scores = evidence_score(
        capture(model, prompt.token_ids).patterns, prompt.question_span, prompt.needle_span
    )
    share = (prompt.needle_span[1] - prompt.needle_span[0]) / prompt.n_tokens  # about 8% of the tokens
    assert scores.max() > 5 * share  # some head reads the needle far above its share of positions
    assert cumulative_mass(scores).half_mass_fraction < 0.2  # measured: about 10% of heads
