"""Top-k vs random curves (analysis/ablation_curve.py): the control stays outside the stated top N,
and the user action stores, reloads and reuses what it measured."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis.ablation import AblationSpec, loss_metric_fn
from headscope.analysis.ablation_curve import ablation_curve, check_curve, load_curve, topk_curve
from headscope.analysis.capture import capture
from headscope.analysis.errors import InputError

TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def zeroed_heads(model, ids, hooks) -> set[tuple[int, int]]:
    """The heads whose ``hook_z`` the hooks set to zero (read after them)."""
    got = {}

    def keep(name):
        def hook(t, hook=None):
            got[name] = t.detach().clone()

        return hook

    names = [get_act_name("z", layer) for layer in range(model.n_layers)]
    with torch.inference_mode():
        model.bridge.run_with_hooks(torch.tensor([ids]), fwd_hooks=list(hooks) + [(n, keep(n)) for n in names],
                                    return_type=None)
    return {(la, h) for la in range(model.n_layers) for h in range(model.n_heads)
            if torch.all(got[names[la]][0, :, h] == 0)}


def test_random_control_draws_from_outside_the_stated_top_n_not_only_the_top_k(tiny_model):
    """With k ≤ 2 and N = 5, no random set holds any of the 5 best heads; the old rule (N = max k)
    would draw from the heads ranked 3rd to 5th too, and with enough seeds does."""
    ids = tiny_model.encode(TEXT)
    scores = np.array([[0.1, 0.9, 0.5, 0.3], [0.8, 0.2, 0.7, 0.0]])  # ranked: 0.1 1.0 1.2 0.2 0.3 | 1.1 0.0 1.3
    seen: list[set] = []

    def metric(model, hooks):
        seen.append(zeroed_heads(model, ids, hooks))
        return float(len(seen[-1]))

    seeds = range(6)
    curve = topk_curve(tiny_model, scores, [0, 1, 2], metric, "zero", seeds, outside_top=5)
    top5 = set(curve.order[:5])
    assert curve.outside_top == 5 and top5 == {(0, 1), (1, 0), (1, 2), (0, 2), (0, 3)}
    random_sets = seen[3:]
    assert random_sets and all(s and s.isdisjoint(top5) for s in random_sets if s)
    seen.clear()
    old = topk_curve(tiny_model, scores, [0, 1, 2], metric, "zero", seeds)
    assert old.outside_top is None  # the rule of curves stored before N was a setting
    assert any(s & (top5 - set(old.order[:2])) for s in seen[3:])  # it does draw ranks 3-5


def test_curve_checks_explain_what_to_change(tiny_model):
    assert check_curve(tiny_model, [3, 0, 3], 2, 2) == [0, 3]
    for ks, seeds, n, message in [([], 1, 0, "at least one k"), ([0, 9], 1, 0, "between 0 and 8"),
                                  ([-1], 1, 0, "between 0 and 8"), ([3], 1, 6, "outside the top 6"),
                                  ([5], 1, 0, "use k up to 4"), ([1], 1, -1, "at least 0"),
                                  ([1], 10**8, 0, "between 0 and 100"), ([1], -1, 0, "between 0 and 100")]:
        with pytest.raises(InputError, match=message):
            check_curve(tiny_model, ks, seeds, n)
    assert check_curve(tiny_model, [8], 0, 20) == [8]  # no random control: any k up to all heads


def test_the_curve_action_stores_its_control_and_reuses_measured_head_sets(tiny_model, store, monkeypatch):
    run = capture(tiny_model, TEXT, store=store)
    scores = np.arange(8, dtype=float).reshape(2, 4)
    spec = AblationSpec((), "zero")
    key, curve, meta = ablation_curve(tiny_model, scores, [2, 0, 1], spec, store, on=run, by_label="a score",
                                      seeds=[0, 1], outside_top=3)
    assert curve.k_values == [0, 1, 2] and curve.complete and curve.outside_top == 3
    assert meta["random_outside_top"] == 3 and meta["metric_label"] == "mean loss (nats)"
    clean = loss_metric_fn(run.token_ids, tiny_model)(tiny_model, [])
    assert curve.top[0] == pytest.approx(clean) and curve.random[:, 0] == pytest.approx([clean, clean])
    loaded, stored_meta = load_curve(store, key)
    assert loaded.outside_top == 3 and stored_meta["by_label"] == "a score"
    np.testing.assert_array_equal(loaded.random, curve.random)
    # another control N is another curve (another key), but head sets measured before are not rerun
    import headscope.analysis.ablation_curve as ac

    calls = []
    real = ac.ablation_hooks
    monkeypatch.setattr(ac, "ablation_hooks", lambda model, spec_: calls.append(spec_.heads) or real(model, spec_))
    key2, again, _ = ablation_curve(tiny_model, scores, [0, 1, 2], spec, store, on=run, by_label="a score",
                                    seeds=[0, 1], outside_top=2)
    assert key2 != key and again.outside_top == 2
    np.testing.assert_array_equal(again.top, curve.top)
    top_sets = {tuple(sorted(curve.order[:k])) for k in (0, 1, 2)}
    assert calls and not top_sets & set(calls)  # only new random sets ran
    with pytest.raises(InputError, match="outside the top 7"):
        ablation_curve(tiny_model, scores, [2], spec, store, on=run, by_label="s", seeds=[0], outside_top=7)


# The Ablation page's "Random k" button and the curve's control draw by one rule (#38 item 19):
# :func:`headscope.analysis.ablation_curve.random_control`.


def test_random_control_never_holds_a_head_of_the_top_n_over_many_seeds():
    from headscope.analysis.ablation_curve import random_control

    rng = np.random.default_rng(7)
    scores = rng.normal(size=(30, 9))
    scores[3, :] = np.nan  # never in the top
    order = [(int(i // 9), int(i % 9)) for i in np.argsort(-np.nan_to_num(scores, nan=-np.inf), axis=None)]
    top20 = set(order[:20])
    seen = set()
    for seed in range(500):
        for k in (1, 5, 20, 40):
            heads = random_control(scores, k, seed)  # N = CONTROL_TOP_N = 20, or k when k is larger
            assert len(heads) == len(set(heads)) == k
            assert not set(heads) & set(order[:max(20, k)]), (seed, k)
            seen |= set(heads)
            assert heads == random_control(scores, k, seed)  # seeded: the same draw again
    assert seen == {(la, h) for la in range(30) for h in range(9)} - top20  # every other head can be drawn
    assert not any(set(random_control(scores, 5, s, outside_top=50)) & set(order[:50]) for s in range(200))


def test_the_curves_random_sets_are_random_control_draws(tiny_model):
    """The curve's seed-s set at k is exactly what "Random k" draws with seed s, k and the curve's N."""
    from headscope.analysis.ablation_curve import random_control

    class Asked(dict):
        """Metric values by head set, recording the sets the curve asks for, in its order."""

        def __init__(self):
            super().__init__()
            self.order = []

        def __contains__(self, heads):
            self.order.append(set(heads))
            return super().__contains__(heads)

    scores = np.arange(tiny_model.n_layers * tiny_model.n_heads, dtype=float).reshape(tiny_model.n_layers, -1)
    asked = Asked()
    curve = topk_curve(tiny_model, scores, [1, 2], lambda model, hooks: 0.0, "zero", random_seeds=(0, 1, 2),
                       outside_top=3, known=asked)
    assert curve.outside_top == 3
    assert asked.order[2:] == [set(random_control(scores, k, seed, outside_top=3))
                               for seed in (0, 1, 2) for k in (1, 2)]  # after the top sets, seed by seed


@pytest.mark.parametrize("k,outside,seed,message", [
    (0, 20, 0, "k must be between 1"), (-3, 20, 0, "k must be between 1"), (271, 20, 0, "k must be between 1"),
    (251, 20, 0, "only 19 remain: use k up to 135,"), (5, -1, 0, "at least 0"), (5, 266, 0, "only 4 remain: use k up to 4,"), (5, 10**30, 0, "only 0 remain: use a smaller top-N"), (1.5, 20, 0, "whole number"), (5, 20, -1, "seed must be"),
    (5, 20, 2**64, "seed must be"),
])
def test_random_control_refuses_what_it_cannot_draw(k, outside, seed, message):
    from headscope.analysis.ablation_curve import random_control

    with pytest.raises(InputError, match=message):
        random_control(np.zeros((30, 9)), k, seed, outside_top=outside)


# n and the 95 % interval of every accuracy a curve shows (#42 item 4)


def test_a_niah_curve_point_rests_on_the_sweeps_prompts_and_its_intervals_are_wilsons():
    from headscope.analysis.ablation_curve import TopkCurve
    from headscope.analysis.intervals import seed_band, wilson

    curve = TopkCurve([0, 2], np.array([1.0, 0.5]), np.array([[1.0, 0.25], [1.0, 0.5], [np.nan, np.nan]]),
                      [0, 1, 2], [(0, 0), (0, 1)], "zero", False, 20, n_prompts=4)
    assert curve.top_accuracy() == [wilson(4, 4), wilson(2, 4)]
    # pooled over the seeds that reached k: 2 seeds × 4 prompts; 1 + 2 of 8 answered at k = 2
    assert curve.random_pooled() == [wilson(8, 8), wilson(3, 8)]
    assert curve.random_band()[1] == seed_band([0.25, 0.5]) and curve.random_band()[1].n_seeds == 2
    loss = TopkCurve([0], np.array([3.2]), np.array([[3.2]]), [0], [], "zero", True)
    assert loss.n_prompts is None and loss.top_accuracy() == [] and loss.random_pooled() == []


def test_a_niah_curve_counts_its_prompts_stored_and_in_an_old_record(tiny_model, store):
    from headscope.analysis.ablation_curve import save_curve
    from headscope.analysis.intervals import wilson
    from headscope.analysis.niah import load_haystack, load_needles
    from headscope.analysis.retrieval import sweep

    swept = sweep(tiny_model, load_needles()[:2], [96], [25, 75], load_haystack("prose"), store=store,
                  max_new_tokens=2)
    scores = np.arange(8, dtype=float).reshape(2, 4)
    key, curve, meta = ablation_curve(tiny_model, scores, [0, 1], AblationSpec((), "zero"), store, on=swept,
                                      by_label="a score", seeds=[0, 1], outside_top=2)
    assert curve.n_prompts == 4 and meta["n_prompts"] == 4
    loaded, _ = load_curve(store, key)
    assert loaded.n_prompts == 4
    assert loaded.top_accuracy() == [wilson(round(v * 4), 4) for v in curve.top]
    # a NIAH curve stored before curves kept their n: counted from the sweep it was measured on
    curve.n_prompts = None
    save_curve(store, "old-curve", curve, {"subject": ["sweep", swept.key], "metric_label": "NIAH accuracy"})
    assert load_curve(store, "old-curve")[0].n_prompts == 4
    # a loss curve has no n
    run = capture(tiny_model, TEXT, store=store)
    _, on_run, meta = ablation_curve(tiny_model, scores, [0, 1], AblationSpec((), "zero"), store, on=run,
                                     by_label="a score", seeds=[0], outside_top=2)
    assert on_run.n_prompts is None and "n_prompts" not in meta


FORGED_COUNTS = [  # (meta n_prompts, top values): a stored NIAH curve's record as a forger might write it
    (10**30, [0.5, 0.25]), (-4, [0.5, 0.25]), (0, [0.5, 0.25]), (True, [0.5, 0.25]), (4.0, [0.5, 0.25]),
    ("4", [0.5, 0.25]), (float("nan"), [0.5, 0.25]), ([4], [0.5, 0.25]), (4, [7.0, 0.25]), (4, [-0.5, 0.25]),
    (4, [0.3, 0.25]), (4, [float("inf"), 0.25]),
]


@pytest.mark.parametrize("n_prompts, top", FORGED_COUNTS)
def test_a_forged_n_or_accuracy_in_a_stored_curve_is_never_drawn_as_an_interval(store, n_prompts, top):
    """A count that is not a whole number of prompts in range, or accuracies that are no share of it:
    the record reads as no n (an n that cannot be counted) or as no curve (values that cannot be
    accuracies), never as an interval from numbers nobody measured, never an exception."""
    from headscope.analysis.ablation_curve import TopkCurve, save_curve

    curve = TopkCurve([0, 1], np.array(top), np.array([[0.5, 0.5]]), [0], [(0, 0)], "zero", True, 1)
    save_curve(store, "forged", curve, {"n_prompts": n_prompts, "metric_label": "NIAH accuracy"})
    found = load_curve(store, "forged")
    valid_n = isinstance(n_prompts, int) and not isinstance(n_prompts, bool) and 1 <= n_prompts <= 10**7
    if not valid_n:
        assert found is not None and found[0].n_prompts is None and found[0].top_accuracy() == []
    else:
        assert found is None
