"""Per-head scores over several prompts: each table equals the score computed directly on that
prompt's captured patterns, the aggregate is their mean and spread, and results are stored."""

import numpy as np
import pytest

from headscope.analysis.capture import capture
from headscope.analysis.errors import InputError
from headscope.analysis.evidence import evidence_score
from headscope.analysis.head_scores import ScoredPrompt, load_head_scores, score_prompts, trial_prompts
from headscope.analysis.score_registry import HEAD_METRICS, HEAD_SCORES
from headscope.analysis.streaming import streaming_score


@pytest.fixture
def prompts(tiny_model):
    texts = ["The cat sat on the mat. The cat sat on the mat again, said the cat.",
             "Alice met Bob in Paris. Later Alice met Bob in Rome, and Alice was happy."]
    return [ScoredPrompt(tiny_model.encode(t), (10, 14), (2, 5)) for t in texts]


def test_scores_equal_direct_computation_and_aggregate_over_prompts(tiny_model, prompts, store):
    result = score_prompts(tiny_model, prompts, sink=2, window=3, store=store)
    assert result.n_prompts == 2 and set(result.names) == set(HEAD_SCORES)  # the registry's scores, evidence too
    for k, p in enumerate(prompts):
        run = capture(tiny_model, p.token_ids, pattern_dtype="float32")
        # every score comes from statistics mode; the reference is each score on float32 patterns
        np.testing.assert_allclose(result.runs["streaming"][k], streaming_score(run.patterns, 2, 3), atol=1e-6)
        for name in set(HEAD_METRICS) - {"streaming"}:  # streaming: S=2, W=3 above
            np.testing.assert_allclose(result.runs[name][k], HEAD_METRICS[name].compute(run.patterns, run.token_ids),
                                       atol=1e-6, err_msg=name)
        np.testing.assert_allclose(result.runs["evidence"][k], evidence_score(run.patterns, (10, 14), (2, 5)),
                                   atol=1e-6)
    for name in result.names:
        stack = result.runs[name]
        np.testing.assert_allclose(result.mean[name], stack.mean(0), equal_nan=True)
        np.testing.assert_allclose(result.std[name], stack.std(0, ddof=1), equal_nan=True)
    again = load_head_scores(store, result.key)
    assert again is not None and again.sink == 2 and again.window == 3
    np.testing.assert_allclose(again.mean["induction"], result.mean["induction"], atol=1e-6)
    # streaming S/W are part of the key: other values are computed afresh
    other = score_prompts(tiny_model, prompts, sink=0, window=1, store=store)
    assert other.key != result.key


def test_no_pattern_capture_at_any_length(tiny_model, prompts, monkeypatch):
    """Every score comes from the one statistics-mode pass: capture (patterns) is never called."""
    import headscope.analysis.head_scores as hs

    def no_patterns(*args, **kwargs):
        raise AssertionError("patterns captured")

    monkeypatch.setattr(hs, "capture", no_patterns)
    result = score_prompts(tiny_model, prompts, sink=2, window=3)
    for name in result.names:
        assert np.isfinite(result.runs[name]).all(), name


def test_bad_requests_say_what_is_wrong(tiny_model, prompts):
    with pytest.raises(InputError, match="at least one prompt"):
        score_prompts(tiny_model, [])
    with pytest.raises(InputError, match="window >= 1"):
        score_prompts(tiny_model, prompts, window=0)


def test_trial_prompts_dedupe_and_carry_the_needle_spans():
    class T:
        def __init__(self, ids):
            self.prompt_ids, self.settings = ids, {"question_span": [5, 7], "needle_span": [1, 3]}

    out = trial_prompts([T([1, 2, 3]), T([1, 2, 3]), T([4, 5])])
    assert [p.token_ids for p in out] == [[1, 2, 3], [4, 5]]
    assert out[0].question_span == (5, 7) and out[0].evidence_span == (1, 3)


def test_scores_of_a_windowed_model_keep_its_windows_and_the_heads_grid_says_so(embedded_tokenizer, store,
                                                                                  monkeypatch):
    """Tiny Gemma 3 (window 6 on layers 0 and 2): the scores over prompts read windowed layers as the
    single-run scores do, the stored result keeps the windows, and the Heads page's score map marks
    those layers and says how the streaming score treats them."""
    from headscope.analysis.models import wrap_model
    from headscope.app.views import heads as views
    from tests.tiny_families import tiny_family_model

    model = wrap_model(tiny_family_model("gemma3", len(embedded_tokenizer)), embedded_tokenizer,
                       name="tiny-gemma3", digest="tiny-gemma3-head-scores")
    ids = model.encode("The cat sat on the mat. The cat sat on the mat again, said the cat by the door.")
    result = score_prompts(model, [ScoredPrompt(ids)], sink=1, window=2, store=store)
    run = capture(model, ids, pattern_dtype="float32")
    np.testing.assert_allclose(result.runs["streaming"][0],
                               streaming_score(run.patterns, 1, 2, layer_windows=[6, None, 6]), atol=1e-6)
    assert result.layer_windows == [6, None, 6] and load_head_scores(store, result.key).layer_windows == [6, None, 6]

    class Sweep:
        scores = np.zeros((3, 4))

    monkeypatch.setattr(views, "sweep_of", lambda params: Sweep())
    monkeypatch.setattr(views, "head_scores_of", lambda sweep, params: result)
    fig, _ = views.head_score_grid_view(None, {"score": "streaming"})
    assert list(fig.layout.yaxis.ticktext) == ["0 w", "1", "2 w"]
    assert "w: windowed by the model (W=6)" in fig.layout.annotations[0].text
