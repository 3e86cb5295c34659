"""The Compress page's policy names: every evaluation of a curve can be named, linked and chosen."""

from __future__ import annotations

import numpy as np
import pytest

from headscope.analysis.errors import InputError
from headscope.analysis.kv_compression import CompressionCurve, KVMemory, Policy, PolicyEvaluation
from headscope.app.url_state import parse
from headscope.app.views.compress import chosen_evaluation, pick_text


def _evaluation(ranking: str, fraction: float, seed: int | None = None, loss: float = 1.0) -> PolicyEvaluation:
    full = np.zeros((2, 3), dtype=bool)
    return PolicyEvaluation(Policy(full, 4, 8, ranking, fraction, seed), KVMemory(100, 50, 100), loss, 0.9, 0.5)


def test_every_policy_of_a_curve_is_named_linked_and_chosen_back_even_with_awkward_fractions():
    # fractions typed in the CLI or Python: an exponent under :g, and more digits than the option shows
    evaluations = [_evaluation("retrieval", 1e-05, loss=1.1), _evaluation("retrieval", 0.1234567, loss=1.2),
                   _evaluation("random", 0.25, 1, loss=1.3), _evaluation("all_streaming", 0.0, loss=1.4)]
    curve = CompressionCurve(evaluations, _evaluation("all_full", 1.0), 4, 8, 1, 1)
    for e in evaluations:
        text = pick_text(e)
        state = parse(f"?pick={text}")
        assert state.pick == text and not state.problems, (text, state.problems)
        assert chosen_evaluation(curve, text, 0.05) is e
    assert [pick_text(e) for e in evaluations] == ["retrieval:0.00001", "retrieval:0.123457", "random:0.25:1",
                                                   "all_streaming"]
    with pytest.raises(InputError, match="no policy"):
        chosen_evaluation(curve, "retrieval:0.5", 0.05)


def _with_accuracy(ranking: str, fraction: float, answered: int, n: int, seed: int | None = None) -> PolicyEvaluation:
    full = np.zeros((2, 3), dtype=bool)
    return PolicyEvaluation(Policy(full, 4, 8, ranking, fraction, seed), KVMemory(100, int(100 * fraction), 100), 2.0,
                            0.9, answered / n, 0.0, n)


def test_the_pareto_figure_draws_each_accuracys_wilson_interval_and_the_decision_says_its_n():
    from headscope.analysis.intervals import wilson
    from headscope.analysis.kv_compression_choices import RANKING_LABELS
    from headscope.app.figures import compression_pareto
    from headscope.app.views.compress import decision_text

    curve = CompressionCurve([_with_accuracy("retrieval", 0.25, 1, 4), _with_accuracy("retrieval", 0.5, 3, 4),
                              _with_accuracy("random", 0.5, 1, 4, 0), _with_accuracy("random", 0.5, 3, 4, 1)],
                             _with_accuracy("all_full", 1.0, 2, 4), 4, 8, 1, 4)
    best = curve.smallest_within("retrieval", 0.05)
    fig = compression_pareto(curve.rows(), curve.baseline.row(), RANKING_LABELS, 0.05,
                             {"retrieval": best.memory.fraction}, "t", curve.seed_bands())
    by_name = {t.name: t for t in fig.data if (t.yaxis or "y") == "y"}
    retrieval = by_name[RANKING_LABELS["retrieval"]]
    want = [wilson(1, 4), wilson(3, 4)]
    np.testing.assert_allclose(retrieval.error_y.array, [w.high - w.value for w in want])
    np.testing.assert_allclose(retrieval.error_y.arrayminus, [w.value - w.low for w in want])
    assert [c[1] for c in retrieval.customdata] == [w.text() for w in want]
    base = next(t for t in fig.data if t.name == "uncompressed" and (t.yaxis or "y") == "y")
    assert base.error_y.array[0] == pytest.approx(wilson(2, 4).high - 0.5) and base.text[0] == "0.50 [0.15, 0.85] n=4"
    # the random mean's bar is the pooled interval of both seeds' 8 prompts; its hover says the seed band
    mean = by_name[f"{RANKING_LABELS['random']} (mean)"]
    assert mean.error_y.array[0] == pytest.approx(wilson(4, 8).high - 0.5)
    assert mean.text[0] == f"seeds 0.25–0.75; pooled {wilson(4, 8).text()}"
    # the loss panel has points only
    assert all(t.error_y.array is None for t in fig.data if t.yaxis == "y2")
    assert decision_text("Retrieval", 0.05, best.row(), 4) == (
        "Smallest KV within 5 NIAH points of full, Retrieval: KV 0.250 (groups full 0.25), NIAH 0.25 [0.05, 0.70] on "
        "n = 4 prompts")
    assert decision_text("Retrieval", 0.05, None, 1) == "Smallest KV within 5 NIAH points of full, Retrieval: none on n = 1 prompt"


def test_the_pareto_figure_shades_the_uncompressed_interval_less_the_tolerance_and_draws_its_line():
    from headscope.analysis.intervals import wilson
    from headscope.analysis.kv_compression_choices import RANKING_LABELS
    from headscope.app.figures import compression_pareto

    curve = CompressionCurve([_with_accuracy("retrieval", 0.25, 1, 4)], _with_accuracy("all_full", 1.0, 2, 4), 4, 8, 1, 4)
    fig = compression_pareto(curve.rows(), curve.baseline.row(), RANKING_LABELS, 0.05, {}, "t")
    rects = [s for s in fig.layout.shapes if s.type == "rect"]
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    base = wilson(2, 4)
    assert len(rects) == 1 and (rects[0].y0, rects[0].y1) == pytest.approx((base.low - 0.05, base.high))
    assert sorted(s.y0 for s in lines) == pytest.approx(sorted([0.5, curve.baseline.loss]))  # both panels
