"""A compression curve on a sweep, stored whole (tiny GQA model): equal to ``evaluate_policies`` called by
hand on the sweep's prompts, read back without computing, not stored when cancelled; and the Pareto
figure's band and marks against the curve's numbers."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import headscope.analysis.kv_compression_sweep as kvs
from headscope.analysis.errors import InputError
from headscope.analysis.head_scores import trial_prompts
from headscope.analysis.kv_compression import evaluate_policies
from headscope.analysis.kv_compression_choices import RANKING_LABELS
from headscope.analysis.niah import load_haystack, load_needles
from headscope.analysis.retrieval import sweep, trial_prompt
from headscope.analysis.store import Store

SINK, RECENT = 4, 16
RANKINGS = ["retrieval", "streaming", "random", "all_streaming"]


@pytest.fixture(scope="module")
def model(make_tiny_model):
    return make_tiny_model(seed=5, name="tiny-kv-sweep")


@pytest.fixture(scope="module")
def swept(model, tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("kv-sweep") / "store")
    return store, sweep(model, load_needles()[:1], [120], [30, 70], load_haystack("prose"), store=store,
                        max_new_tokens=3)


def test_stored_curve_equals_evaluate_policies_and_reopens_without_computing(model, swept, monkeypatch):
    store, result = swept
    stored = kvs.compress_sweep(model, result, RANKINGS, [0.25, 0.5], seeds=[0, 1], sink_size=SINK,
                                recent_size=RECENT, store=store)
    assert stored.key and stored.curve.complete
    # by hand: the sweep's retrieval scores, the streaming score with the policy's S and W
    from headscope.analysis.head_scores import score_prompts

    streaming = score_prompts(model, trial_prompts(result.trials), sink=SINK, window=RECENT).mean["streaming"]
    by_hand = evaluate_policies(model, {"retrieval": result.scores, "streaming": streaming}, RANKINGS, [0.25, 0.5],
                                texts=[p.token_ids for p in trial_prompts(result.trials)],
                                prompts=[trial_prompt(t) for t in result.trials], seeds=[0, 1], sink_size=SINK,
                                recent_size=RECENT)
    assert len(stored.curve.evaluations) == len(by_hand.evaluations) == 2 + 2 + 4 + 1
    for got, want in zip([stored.curve.baseline, *stored.curve.evaluations],
                         [by_hand.baseline, *by_hand.evaluations], strict=True):
        np.testing.assert_array_equal(got.policy.full, want.policy.full)
        assert (got.policy.ranking, got.policy.fraction, got.policy.seed) == (
            want.policy.ranking, want.policy.fraction, want.policy.seed)
        assert got.loss == pytest.approx(want.loss, rel=1e-6) and got.agreement == want.agreement
        assert got.niah_accuracy == want.niah_accuracy or (np.isnan(got.niah_accuracy) and np.isnan(want.niah_accuracy))
        assert got.memory == want.memory

    # the same inputs read the one record back: nothing is evaluated
    def refuse(*a, **k):
        raise AssertionError("evaluated again")

    monkeypatch.setattr(kvs, "evaluate_policies", refuse)
    monkeypatch.setattr(kvs, "sweep_scores", refuse)
    again = kvs.compress_sweep(model, result, RANKINGS, [0.5, 0.25], seeds=[0, 1], sink_size=SINK,
                               recent_size=RECENT, store=store)
    assert again.key == stored.key
    assert json.dumps(again.curve.rows()) == json.dumps(stored.curve.rows())  # nan-safe: every digit equal
    key, found = kvs.find_curve(store, stored.key[:16])
    assert key == stored.key and [e.loss for e in found.evaluations] == [e.loss for e in stored.curve.evaluations]
    with pytest.raises(InputError, match="No stored compression curve"):
        kvs.find_curve(store, result.key[:16])  # a sweep record is no curve


def test_a_cancelled_curve_is_not_stored_and_s_plus_w_must_leave_keys_out(model, swept):
    store, result = swept
    stop = threading.Event()
    part = kvs.compress_sweep(model, result, ["retrieval"], [0.5], seeds=[0], sink_size=SINK, recent_size=RECENT + 1,
                              store=store, progress=lambda f: stop.set(), cancel=stop)  # after the baseline
    assert not part.curve.complete and part.key == "" and part.curve.evaluations == []
    key = kvs.curve_key(model, result.key, ["retrieval"], [0.5], [0], SINK, RECENT + 1)
    assert kvs.load_curve(store, key) is None
    with pytest.raises(InputError, match="nothing to compress"):
        kvs.compress_sweep(model, result, ["retrieval"], [0.5], sink_size=100, recent_size=100, store=store)


def test_pareto_figure_band_and_marks_are_the_curves_numbers(model, swept):
    from headscope.app.figures import compression_pareto

    store, result = swept
    curve = kvs.compress_sweep(model, result, RANKINGS, [0.25, 0.5], seeds=[0, 1], sink_size=SINK,
                               recent_size=RECENT, store=store).curve
    rows = curve.rows()
    best = {r: curve.smallest_within(r, 1.0) for r in ("retrieval", "random")}  # tolerance 1: every policy passes
    assert all(e is not None for e in best.values())
    fig = compression_pareto(rows, curve.baseline.row(), RANKING_LABELS, 1.0,
                             {r: e.memory.fraction for r, e in best.items()}, "t")
    traces = [t for t in fig.data if t.yaxis in ("y", None) or t.yaxis == "y"]
    by_name = {t.name: t for t in traces}
    # one curve per score ranking, x = KV fraction kept, y = NIAH accuracy, in fraction order
    retrieval = by_name[RANKING_LABELS["retrieval"]]
    mine = sorted((r for r in rows if r["ranking"] == "retrieval"), key=lambda r: r["kv_fraction"])
    assert list(retrieval.x) == [r["kv_fraction"] for r in mine]
    assert list(retrieval.y) == [r["niah_accuracy"] for r in mine]
    # random: the band spans the lowest to the highest seed at each fraction, the line is their mean
    band = next(t for t in traces if t.name.startswith(RANKING_LABELS["random"] + ": 2 seeds"))
    xs = sorted({round(r["kv_fraction"], 12) for r in rows if r["ranking"] == "random"})
    per = [[r["niah_accuracy"] for r in rows if r["ranking"] == "random" and round(r["kv_fraction"], 12) == x]
           for x in xs]
    assert list(band.y) == [max(v) for v in per] + [min(v) for v in per][::-1]
    mean = by_name[f"{RANKING_LABELS['random']} (mean)"]
    np.testing.assert_allclose(mean.y, [np.mean(v) for v in per])
    # the uncompressed model is a point at KV 1.0 in both panels, so each axis range includes it
    for panel, metric in (("y", "niah_accuracy"), ("y2", "loss")):
        point = next(t for t in fig.data if t.name == "uncompressed" and (t.yaxis or "y") == panel)
        assert list(point.x) == [1.0] and list(point.y) == [pytest.approx(curve.baseline.row()[metric])]
    # the smallest KV fraction within the tolerance: a star per ranking at that fraction
    stars = next(t for t in traces if t.name.startswith("smallest KV within"))
    assert sorted(stars.x) == sorted(e.memory.fraction for e in best.values())
    assert min(stars.x) == min(r["kv_fraction"] for r in rows if r["ranking"] in ("retrieval", "random"))


def test_every_accuracy_of_a_stored_curve_rests_on_the_sweeps_prompts(model, swept):
    """Each evaluation's NIAH accuracy carries n = the sweep's prompts, computed and read back alike."""
    from headscope.analysis.intervals import wilson

    store, result = swept
    stored = kvs.compress_sweep(model, result, RANKINGS, [0.25, 0.5], seeds=[0, 1], sink_size=SINK,
                                recent_size=RECENT, store=store)
    n = len(result.trials)
    back = kvs.load_curve(store, stored.key)
    for curve in (stored.curve, back):
        assert curve.n_prompts == n
        for e in [curve.baseline, *curve.evaluations]:
            want = wilson(round(e.niah_accuracy * n), n)
            assert (e.niah_n, e.row()["niah_accuracy_low"], e.row()["niah_accuracy_high"]) == (n, want.low, want.high)
