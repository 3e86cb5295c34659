"""The Heads page's and ``headscope scan``'s one action (:func:`headscope.analysis.head_scan.scan`) on a tiny
random Llama: the scores it returns are the ones the page's figures show, a second scan computes
nothing, and what it refuses it refuses before decoding anything."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from headscope.analysis.errors import InputError
from headscope.analysis.head_scan import scan, sweep_head_scores
from headscope.analysis.head_scores import load_head_scores
from headscope.analysis.niah import Needle, named_haystack

NEEDLE = Needle(needle="The combination for the blue locker is 4817.",
                question="What is the combination for the blue locker?", answer="4817", id="locker")
SPEC = "tiny-scan"  # the name the page loads the model by (registered in the model cache by the fixture)


@pytest.fixture(scope="module")
def tiny(make_tiny_model):
    return make_tiny_model(max_positions=1024, name=SPEC)


@pytest.fixture
def page_context(tiny, store, monkeypatch):
    """The app's context on ``store``, with the tiny model loadable by name as the page loads models."""
    from headscope.analysis import models
    from headscope.app.context import AppContext, set_context

    monkeypatch.setitem(models._models, (SPEC, "cpu"), tiny)
    set_context(AppContext(store=store, default_model=SPEC))
    return store


def _scan(model, store, **kw):
    return scan(model, [NEEDLE], [160], [20, 80], named_haystack("prose"), sink=2, window=8, max_new_tokens=3,
                store=store, **kw)


def test_scan_returns_the_scores_the_heads_page_shows(tiny, page_context):
    from headscope.app.views import VIEWS, names

    found = _scan(tiny, page_context)
    sweep, scores = found.sweep, found.scores
    assert len(sweep.trials) == 2 and scores is not None and scores.n_prompts == 2
    assert {"streaming", "entropy", "induction", "evidence"} <= set(scores.names)
    params = {"model": SPEC, "sweep": sweep.key[:16], "agg": "query", "sink_size": 2, "window": 8, "stat": "mean",
              "layer": None, "head": None, "trial": 0}
    _, rows = VIEWS[names.RETRIEVAL_GRID].build(None, params)
    np.testing.assert_array_equal(np.array([r["retrieval"] for r in rows]).reshape(sweep.scores.shape),
                                  sweep.scores)
    for name in scores.names:
        _, rows = VIEWS[names.HEAD_SCORE_GRID].build(None, {**params, "score": name})
        shape = scores.mean[name].shape
        np.testing.assert_array_equal(np.array([r["mean"] for r in rows]).reshape(shape), scores.mean[name])
        np.testing.assert_array_equal(np.array([r["std"] for r in rows]).reshape(shape), scores.std[name])
        assert {r["n_prompts"] for r in rows} == {2}
    # the streaming score with the scan's own S and W, as the page labels it
    fig, _ = VIEWS[names.HEAD_SCORE_GRID].build(None, {**params, "score": "streaming"})
    assert "(S=2, W=8)" in fig.layout.title.text


def test_a_second_scan_reuses_every_trial_and_reads_the_scores_back(tiny, store, monkeypatch):
    first = _scan(tiny, store)
    assert load_head_scores(store, first.scores.key) is not None

    def no_forward_pass(*args, **kwargs):
        raise AssertionError("the scores were computed again")

    monkeypatch.setattr("headscope.analysis.head_scores._score_prompt", no_forward_pass)
    seen = []
    again = _scan(tiny, store, scores_progress=seen.append)
    assert again.sweep.key == first.sweep.key and all(t.reused for t in again.sweep.trials)
    assert again.scores.key == first.scores.key and seen == [1.0]
    for name in first.scores.names:
        np.testing.assert_array_equal(again.scores.mean[name], first.scores.mean[name])
    # what the page's figures read: the same stored scores for the same S and W
    assert sweep_head_scores(tiny, again.sweep, sink=2, window=8, store=store).key == first.scores.key


def test_progress_reaches_the_end_of_both_parts(tiny, store):
    trials, scored = [], []
    _scan(tiny, store, progress=trials.append, scores_progress=scored.append)
    assert trials and trials[-1] == 1.0 and trials == sorted(trials)
    assert scored and scored[-1] == 1.0 and scored == sorted(scored)


def test_a_cancelled_scan_keeps_its_trials_and_scores_nothing(tiny, store):
    stop = threading.Event()
    stop.set()
    found = _scan(tiny, store, cancel=stop.is_set)
    assert found.scores is None and found.sweep.cancelled and found.sweep.trials == []
    assert store.list(kind="head_scores") == []


@pytest.mark.parametrize("kw, words", [
    ({"sink": 100, "window": 60}, r"S \+ W = 160 leaves no query rows"),  # no query row in a 160-token prompt
    ({"sink": -1}, "sink size S"),
    ({"window": 0}, "window W"),
    ({"sink": 2.5}, "sink size S"),
    ({"window": True}, "window W"),
    ({"sink": "4"}, "sink size S"),
    ({"lengths": []}, "at least one context length"),
    ({"needles": []}, "at least one needle"),
    ({"depths": [150]}, "epth"),
])
def test_what_a_scan_refuses_it_refuses_before_decoding(tiny, store, kw, words):
    args = {"needles": [NEEDLE], "lengths": [160], "depths": [50], "sink": 4, "window": 8, **kw}
    with pytest.raises(InputError, match=words):
        scan(tiny, args["needles"], args["lengths"], args["depths"], named_haystack("prose"), sink=args["sink"],
             window=args["window"], max_new_tokens=2, store=store)
    assert store.list(kind="retrieval_trial") == []
