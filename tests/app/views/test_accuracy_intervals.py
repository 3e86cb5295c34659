"""Every needle-in-a-haystack accuracy the Heads and Ablation views show carries its n and a 95 %
Wilson interval (#42 item 4): in the rows the CSV export writes, in the hover text and the figure's
error bars, equal to :func:`headscope.analysis.intervals.wilson` of the counts the analysis keeps.

One stored sweep on the embedded model: two needles in the passkey haystack, one the model answers
and one whose answer is nowhere in the text (never answered), so a cell holds 1 of 2 at most; and one
NIAH top-k curve on it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from headscope.analysis.intervals import from_accuracy, seed_band, wilson
from headscope.analysis.niah import Needle, named_haystack

pytestmark = pytest.mark.integration

NEEDLES = [Needle(needle="The secret passkey is 7731.", question="What is the secret passkey?", answer="7731",
                  id="passkey-7731"),
           Needle(needle="The secret passkey is 7731.", question="What is the secret passkey?", answer="walrus",
                  id="never-answered")]


@pytest.fixture(scope="module")
def stored(real_model, tmp_path_factory):
    """(store, sweep, curve key, curve) in the context the views read, restored after."""
    import torch

    from headscope.analysis.ablation import AblationSpec
    from headscope.analysis.ablation_curve import ablation_curve
    from headscope.analysis.retrieval import sweep
    from headscope.analysis.store import Store
    from headscope.app import context
    from headscope.app.context import AppContext, set_context

    store = Store(tmp_path_factory.mktemp("intervals") / "home")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        swept = sweep(real_model, NEEDLES, [160], [25, 75], named_haystack("passkey"), store=store, max_new_tokens=12)
        key, curve, _ = ablation_curve(real_model, np.nan_to_num(swept.scores), [0, 1], AblationSpec((), "zero"),
                                       store, on=swept, by_label="Retrieval score", seeds=[0, 1], outside_top=1)
    finally:
        torch.set_num_threads(threads)
    before = context._context
    set_context(AppContext(store=store, default_model="smollm2-135m"))
    yield store, swept, key, curve
    context._context = before
    store.close()


def _same(p, row, name):
    assert row[f"{name}_n"] == p.n and row[name] == pytest.approx(p.value)
    assert row[f"{name}_low"] == pytest.approx(p.low) and row[f"{name}_high"] == pytest.approx(p.high)


def test_the_niah_grid_rows_hover_and_title_carry_n_and_the_wilson_interval(stored):
    from headscope.app.views import names
    from headscope.app.views.registry import VIEWS

    _, swept, _, _ = stored
    answered, n = swept.cell_counts()
    assert n.tolist() == [[2, 2]]  # one trial per needle per cell
    assert answered.max() == 1, "the passkey needle should be answered at 160 tokens and the other never"
    fig, rows = VIEWS[names.NIAH_GRID].build(None, {"sweep": swept.key[:16]})
    assert [(r["length"], r["depth"]) for r in rows] == [(160, 25.0), (160, 75.0)]
    heat = fig.data[0]
    for j, row in enumerate(rows):
        p = wilson(int(answered[0, j]), 2)
        _same(p, row, "accuracy")
        assert row["accuracy_answered"] == p.successes
        assert p.text() in heat.customdata[0][j] and f"{p.successes} of 2 answered" in heat.customdata[0][j]
    assert "%{customdata}" in heat.hovertemplate
    overall = wilson(swept.n_counted, swept.n_trials)
    assert overall.text() in fig.layout.title.text


def test_a_niah_curves_rows_and_error_bars_are_the_wilson_intervals_and_the_seed_band(stored):
    from headscope.app.views import names
    from headscope.app.views.registry import VIEWS

    _, swept, key, curve = stored
    assert curve.n_prompts == 4
    fig, rows = VIEWS[names.ABLATION_CURVE].build(None, {"curve": key[:16]})
    top = [r for r in rows if r["set"] == "top"]
    for j, r in enumerate(top):
        _same(from_accuracy(curve.top[j], 4), r, "value")
    for r in (r for r in rows if r["set"] == "random"):
        s, j = curve.seeds.index(r["seed"]), curve.k_values.index(r["k"])
        _same(from_accuracy(curve.random[s, j], 4), r, "value")
    pooled = [r for r in rows if r["set"] == "random, all seeds"]
    assert [r["k"] for r in pooled] == curve.k_values
    for j, r in enumerate(pooled):
        total = int(round(float(curve.random[:, j].sum()) * 4))
        _same(wilson(total, 8), r, "value")
        band = seed_band(curve.random[:, j])
        assert (r["seed_low"], r["seed_high"], r["n_seeds"]) == (band.low, band.high, 2)
    line = next(t for t in fig.data if t.name == "top-k heads")
    ci = [wilson(round(v * 4), 4) for v in curve.top]
    assert line.error_y.array == pytest.approx([p.high - p.value for p in ci])
    assert line.error_y.arrayminus == pytest.approx([p.value - p.low for p in ci])
    assert "95 %" in line.hovertemplate or "95 %" in "".join(line.customdata)
    band = next(t for t in fig.data if "lowest" in (t.name or ""))
    assert band.fill == "toself" and "2 seeds" in band.name
    mean = next(t for t in fig.data if (t.name or "").endswith("(mean)"))
    p = wilson(int(round(float(curve.random[:, 1].sum()) * 4)), 8)
    assert mean.error_y.array[1] == pytest.approx(p.high - p.value)


def test_a_loss_curves_rows_and_figure_keep_no_interval_columns(stored, real_model):
    from headscope.analysis.ablation import AblationSpec
    from headscope.analysis.ablation_curve import ablation_curve
    from headscope.analysis.capture import capture
    from headscope.app.views import names
    from headscope.app.views.registry import VIEWS

    store, swept, _, _ = stored
    run = capture(real_model, "The quick brown fox jumps over the lazy dog.", store=store)
    key, _, _ = ablation_curve(real_model, np.nan_to_num(swept.scores), [0, 1], AblationSpec((), "zero"), store,
                               on=run, by_label="Retrieval score", seeds=[0, 1], outside_top=1)
    fig, rows = VIEWS[names.ABLATION_CURVE].build(None, {"curve": key[:16]})
    assert not any("value_n" in r for r in rows) and {r["set"] for r in rows} == {"top", "random"}
    assert any(t.name == "random ± std" for t in fig.data)  # the loss curve's seed band, as before
    assert all(t.error_y is None or t.error_y.array is None for t in fig.data)
    assert not math.isnan(rows[0]["value"])
