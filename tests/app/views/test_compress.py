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
