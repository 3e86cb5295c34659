"""Tests of analysis/patching.py against independent references: a plain loop of one forward pass per
patched unit with a plain TransformerLens hook (no batching, full logits), central finite differences
for attribution patching, and endpoints that hold by construction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis.errors import InputError
from headscope.analysis.patching import activation_patching, agreement, prompt_pair
from headscope.analysis.path_patching import layer_units, patch_together, path_patching

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
ANSWERS = [" Mary", " John"]


def hook_name(model, site: str, layer: int) -> str:
    if site == "resid":
        return get_act_name("resid_post", layer - 1) if layer == model.n_layers else get_act_name("resid_pre", layer)
    return get_act_name(site, layer)


def last_logits(model, ids, hooks=()):
    with torch.inference_mode():
        out = model.bridge.run_with_hooks(torch.tensor([list(ids)]), fwd_hooks=list(hooks), return_type="logits")
    return out[0, -1].double()


def metric(logits, answers, kind="logit_diff"):
    if kind == "logit_diff":
        return float(logits[answers[0]] - logits[answers[1]])
    return float(-torch.log_softmax(logits, -1)[answers[0]])


def activation(model, ids, site, layer):
    got = {}

    def keep(t, hook):
        got["a"] = t[0].detach().clone()

    with torch.no_grad():  # not inference_mode: these tensors become dual numbers below
        model.bridge.run_with_hooks(torch.tensor([list(ids)]), fwd_hooks=[(hook_name(model, site, layer), keep)],
                                    return_type=None)
    return got["a"]


def brute_force(model, pair, site, direction, units, kind="logit_diff"):
    """One forward pass per unit ``(layer, head or None, position or None)``, normalised by hand."""
    m_clean = metric(last_logits(model, pair.clean_ids), pair.answers, kind)
    m_corr = metric(last_logits(model, pair.corrupted_ids), pair.answers, kind)
    receive, source = ((pair.corrupted_ids, pair.clean_ids) if direction == "denoise"
                       else (pair.clean_ids, pair.corrupted_ids))
    out = []
    for layer, h, p in units:
        src = activation(model, source, site, layer)

        def patch(t, hook, h=h, p=p, src=src):
            t = t.clone()
            if h is None:
                t[0, p] = src[p]
            elif p is None:
                t[0, :, h] = src[:, h]
            else:
                t[0, p, h] = src[p, h]
            return t

        m = metric(last_logits(model, receive, [(hook_name(model, site, layer), patch)]), pair.answers, kind)
        out.append((m - m_corr) / (m_clean - m_corr))
    return np.array(out)


@pytest.mark.parametrize("site", ["z", "q", "k", "v"])
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_batched_head_patching_equals_one_forward_per_head(tiny_model, site, direction):
    result = activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site=site, direction=direction,
                                 batch_size=3)  # batches that straddle layers
    n = tiny_model.n_kv_heads if site in ("k", "v") else tiny_model.n_heads
    assert result.values.shape == (tiny_model.n_layers, n)
    units = [(la, h, None) for la in range(tiny_model.n_layers) for h in range(n)]
    expected = brute_force(tiny_model, result.pair, site, direction, units).reshape(result.values.shape)
    np.testing.assert_allclose(result.values, expected, atol=1e-4)
    assert np.abs(expected - result.baseline).max() > 50 * 1e-4  # well above the tolerance: a wrong head shows
    if site in ("k", "v"):
        assert "key-value head" in result.unit and "query heads" in result.unit


def test_residual_map_equals_brute_force_and_its_endpoints_are_exact(tiny_model):
    den = activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site="resid", direction="denoise")
    noise = activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site="resid", direction="noise")
    n = den.pair.n_tokens
    assert den.values.shape == (tiny_model.n_layers + 1, n)
    units = [(la, None, p) for la in range(tiny_model.n_layers + 1) for p in range(n)]
    np.testing.assert_allclose(den.values.ravel(), brute_force(tiny_model, den.pair, "resid", "denoise", units),
                               atol=1e-4)
    # After the last layer the last position is all the logits read: patching it is the other run.
    assert den.values[-1, -1] == pytest.approx(1.0, abs=1e-4)
    assert noise.values[-1, -1] == pytest.approx(0.0, abs=1e-4)
    # One token differs: patching its embedding (layer 0) turns one prompt into the other.
    (diff,) = den.pair.differ
    assert den.values[0, diff] == pytest.approx(1.0, abs=1e-4)
    assert noise.values[0, diff] == pytest.approx(0.0, abs=1e-4)
    # Positions before the difference carry the same activations in both runs: patching them is a no-op.
    np.testing.assert_allclose(den.values[:, :diff], 0.0, atol=1e-4)
    np.testing.assert_allclose(noise.values[:, :diff], 1.0, atol=1e-4)


@pytest.mark.parametrize("site,head", [("z", (1, 2)), ("k", (0, 1))])
def test_per_position_patching_of_one_head_equals_brute_force(tiny_model, site, head):
    result = activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site=site, head=head)
    n = result.pair.n_tokens
    assert result.values.shape == (n,)
    units = [(head[0], head[1], p) for p in range(n)]
    np.testing.assert_allclose(result.values, brute_force(tiny_model, result.pair, site, "denoise", units), atol=1e-4)
    whole = activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site=site)
    if head[0] == tiny_model.n_layers - 1:
        # In the last layer only the last position reaches the logits.
        np.testing.assert_allclose(result.values[:-1], 0.0, atol=1e-4)
        assert result.values[-1] == pytest.approx(whole.values[head], abs=1e-4)


@pytest.mark.parametrize("site", ["z", "v", "resid"])
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_attribution_is_the_first_order_term(tiny_model, site, direction):
    """Attribution patching (reverse mode, all units at once) against the directional derivative
    d/dε m(a_receiving + ε (a_source − a_receiving)) at ε = 0 of each unit, computed independently by
    forward-mode differentiation (dual numbers through the same hooks; exact up to float32 rounding)
    and by central finite differences (ε = 1e-2; float32 rounding limits these to about 1e-3)."""
    import torch.autograd.forward_ad as fwAD

    result = activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site=site, direction=direction,
                                 attribution=True)
    pair = result.pair
    receive, source = ((pair.corrupted_ids, pair.clean_ids) if direction == "denoise"
                       else (pair.clean_ids, pair.corrupted_ids))
    m_receive = result.corrupted if direction == "denoise" else result.clean
    predicted = (result.attribution * (result.clean - result.corrupted) + result.corrupted - m_receive).ravel()
    if site == "resid":
        units = [(la, None, p) for la in range(tiny_model.n_layers + 1) for p in (pair.differ[0], pair.n_tokens - 1)]
        index = [la * pair.n_tokens + p for la, _, p in units]
    else:
        n = result.attribution.shape[1]
        units = [(la, h, None) for la in range(tiny_model.n_layers) for h in range(n)]
        index = list(range(len(units)))
    for (layer, h, p), i in zip(units, index, strict=True):
        a_src = activation(tiny_model, source, site, layer)
        a_rec = activation(tiny_model, receive, site, layer)
        where = (slice(None) if p is None else p,) + (() if h is None else (h,))
        direction_t = torch.zeros_like(a_rec)
        direction_t[where] = a_src[where] - a_rec[where]

        def dual(t, hook, a_rec=a_rec, d=direction_t):
            return fwAD.make_dual(a_rec[None], d[None])

        with torch.no_grad(), fwAD.dual_level():
            logits = tiny_model.bridge.run_with_hooks(torch.tensor([list(receive)]),
                                                      fwd_hooks=[(hook_name(tiny_model, site, layer), dual)],
                                                      return_type="logits")
            tangent = fwAD.unpack_dual(logits).tangent[0, -1].double()
        exact_first_order = float(tangent[pair.answers[0]] - tangent[pair.answers[1]])
        assert predicted[i] == pytest.approx(exact_first_order, rel=1e-4, abs=1e-5), (layer, h, p)

        values = []
        for sign in (1, -1):

            def nudge(t, hook, sign=sign, a_rec=a_rec, d=direction_t, eps=1e-2):
                return (a_rec + sign * eps * d)[None]

            values.append(metric(last_logits(tiny_model, receive, [(hook_name(tiny_model, site, layer), nudge)]),
                                 pair.answers))
        assert predicted[i] == pytest.approx((values[0] - values[1]) / 2e-2, rel=1e-2, abs=2e-3), (layer, h, p)
    assert result.agreement is not None and result.agreement.n_units == result.values.size


def test_loss_metric_with_one_answer_is_normalised_by_its_own_endpoints(tiny_model):
    result = activation_patching(tiny_model, CLEAN, CORRUPTED, [" Mary"], site="resid", metric="loss")
    units = [(la, None, p) for la in range(tiny_model.n_layers + 1) for p in range(result.pair.n_tokens)]
    expected = brute_force(tiny_model, result.pair, "resid", "denoise", units, kind="loss")
    np.testing.assert_allclose(result.values.ravel(), expected, atol=1e-4)
    assert result.values[-1, -1] == pytest.approx(1.0, abs=1e-4)
    assert result.clean == pytest.approx(metric(last_logits(tiny_model, result.pair.clean_ids),
                                                result.pair.answers, "loss"), abs=1e-4)


def test_unequal_lengths_are_refused_naming_both_lengths_and_where(tiny_model):
    with pytest.raises(InputError) as e:
        prompt_pair(tiny_model, CLEAN, "When Mary and John went to the big store, Mary gave a drink to", ANSWERS)
    message = str(e.value)
    clean_n = len(tiny_model.encode(CLEAN))
    other_n = len(tiny_model.encode("When Mary and John went to the big store, Mary gave a drink to"))
    assert clean_n != other_n
    assert f"{clean_n} tokens" in message and f"corrupted prompt {other_n}" in message
    assert "first differ at token 7" in message


@pytest.mark.parametrize("answers,message", [
    ([" Marylebone", " John"], "is 3 tokens"),
    (["drink", " John"], "' drink', with its leading space, is one token"),
    ([" Mary", " Mary"], "the same token"),
    ([" Mary", " John", " Bob"], "one or two answers"),
    ([""], "answer is empty"),
])
def test_answers_must_be_single_distinct_tokens(tiny_model, answers, message):
    with pytest.raises(InputError, match=message):
        prompt_pair(tiny_model, CLEAN, CORRUPTED, answers)


def test_float_token_ids_in_a_pair_are_refused_not_truncated(tiny_model):
    """[5, 6.7] against [5, 7] would otherwise patch [5, 6] against [5, 7]: a pair nobody asked for."""
    with pytest.raises(InputError, match="whole numbers"):
        prompt_pair(tiny_model, [5, 6.7], [5, 7], [3, 4])


def test_pairs_and_settings_that_cannot_be_patched_are_explained(tiny_model):
    with pytest.raises(InputError, match="same tokens"):
        prompt_pair(tiny_model, CLEAN, CLEAN, ANSWERS)
    with pytest.raises(InputError, match="needs two answers"):
        activation_patching(tiny_model, CLEAN, CORRUPTED, [" Mary"])
    with pytest.raises(InputError, match="site 'o'"):
        activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site="o")
    with pytest.raises(InputError, match="out of range"):
        activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site="k", head=(0, 2))  # 2 kv heads
    with pytest.raises(InputError, match="already per position"):
        activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site="resid", head=(0, 0))


def test_stored_result_is_returned_and_a_cancel_keeps_what_finished(tiny_model, store, monkeypatch):
    import headscope.analysis.patching as patching

    calls = []
    result = activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, attribution=True, store=store,
                                 progress=calls.append)
    assert calls[-1] == pytest.approx(1.0) and result.complete
    monkeypatch.setattr(patching, "_exact", lambda *a, **k: pytest.fail("recomputed a stored result"))
    again = activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, attribution=True, store=store)
    np.testing.assert_array_equal(again.values, result.values)
    np.testing.assert_array_equal(again.attribution, result.attribution)
    assert again.agreement == result.agreement and again.pair == result.pair
    monkeypatch.undo()

    batches = []
    partial = activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site="q", batch_size=2, store=store,
                                  progress=batches.append, cancel=lambda: len(batches) >= 1)
    assert not partial.complete
    assert np.isfinite(partial.values).sum() == 2 and np.isnan(partial.values).sum() == partial.values.size - 2
    full = activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site="q")
    np.testing.assert_allclose(partial.values.ravel()[:2], full.values.ravel()[:2], atol=1e-4)
    assert store.find(partial.key) == []  # a partial result is not stored


def test_agreement_counts_the_top_k_by_effect_size():
    exact = np.array([0.9, -0.8, 0.1, 0.0, 0.05])
    approx = np.array([0.7, 0.05, -0.6, 0.0, 0.02])
    a = agreement(exact, approx, baseline=0.0, k=2)
    assert a.overlap == 0.5 and a.k == 2 and a.n_units == 5  # {0, 1} vs {0, 2}
    assert a.pearson == pytest.approx(np.corrcoef(exact, approx)[0, 1])
    noise = agreement(1 - exact, 1 - approx, baseline=1.0, k=2)
    assert noise.overlap == 0.5 and noise.pearson == pytest.approx(a.pearson)


# ---------------------------------------------------------------------------------------------
# Several units at once


def source_and_receive(pair, direction):
    return ((pair.clean_ids, pair.corrupted_ids) if direction == "denoise" else (pair.corrupted_ids, pair.clean_ids))


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_patching_nothing_is_the_receiving_run_exactly(tiny_model, direction):
    got = patch_together(tiny_model, CLEAN, CORRUPTED, ANSWERS, [], direction=direction)
    source, receive = source_and_receive(got.pair, direction)
    assert got.raw == pytest.approx(metric(last_logits(tiny_model, receive), got.pair.answers), abs=1e-5)
    assert got.value == (0.0 if direction == "denoise" else 1.0)  # exactly: the same computation as the endpoint


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_a_whole_layers_heads_equal_its_attention_output(tiny_model, direction):
    """Σ_h W_O[h]·z[h] is hook_attn_out: patching every head's z of layer l is patching attn_out of
    layer l, checked against a plain hook on hook_attn_out with the source run's activation."""
    for layer in range(tiny_model.n_layers):
        heads = patch_together(tiny_model, CLEAN, CORRUPTED, ANSWERS, layer_units(tiny_model, layer),
                               direction=direction)
        source, receive = source_and_receive(heads.pair, direction)
        name = get_act_name("attn_out", layer)
        src = {}
        with torch.no_grad():
            tiny_model.bridge.run_with_hooks(torch.tensor([list(source)]), return_type=None,
                                             fwd_hooks=[(name, lambda t, hook, src=src: src.setdefault("a", t.clone()))])
        by_hand = metric(last_logits(tiny_model, receive, [(name, lambda t, hook, src=src: src["a"])]), heads.pair.answers)
        assert heads.raw == pytest.approx(by_hand, abs=1e-4)
        assert abs(heads.value - (0.0 if direction == "denoise" else 1.0)) > 1e-2  # the layer matters


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_every_writer_into_the_residual_stream_together_is_the_source_run(tiny_model, direction):
    """Embedding + every head's z in every layer + every MLP output rebuild the source run's residual
    stream, so the value is exactly the source's (1 denoising, 0 noising). The logits read the last
    position only, which other positions reach only through attention: with the same last token the
    heads alone restore them (all positions, or the last one alone); with different last tokens they
    do not, and the last position's embedding with them does."""
    n_layers = tiny_model.n_layers
    heads = [u for la in range(n_layers) for u in layer_units(tiny_model, la)]
    mlps = [("mlp_out", la, None, None) for la in range(n_layers)]
    target = 1.0 if direction == "denoise" else 0.0
    everything = patch_together(tiny_model, CLEAN, CORRUPTED, ANSWERS, [("embed", None, None, None), *heads, *mlps],
                                direction=direction)
    assert everything.value == pytest.approx(target, abs=1e-5)
    last = everything.pair.n_tokens - 1
    assert everything.pair.differ == (9,)  # the last token is the same
    for units in (heads, [(s, la, h, last) for s, la, h, _ in heads]):
        assert patch_together(tiny_model, CLEAN, CORRUPTED, ANSWERS, units, direction=direction).value == \
            pytest.approx(target, abs=1e-5)
    assert abs(patch_together(tiny_model, CLEAN, CORRUPTED, ANSWERS, [(s, la, h, last - 1) for s, la, h, _ in heads],
                              direction=direction).value - target) > 1e-2  # not the last position: not restored

    corrupted_end = CORRUPTED[: -len(" to")] + " for"  # a different last token as well
    heads_only = patch_together(tiny_model, CLEAN, corrupted_end, ANSWERS, heads, direction=direction)
    assert heads_only.pair.differ[-1] == last
    assert abs(heads_only.value - target) > 1e-2
    with_embedding = patch_together(tiny_model, CLEAN, corrupted_end, ANSWERS,
                                    [("embed", None, None, last), *heads], direction=direction)
    assert with_embedding.value == pytest.approx(target, abs=1e-5)
    as_attn_out = patch_together(tiny_model, CLEAN, corrupted_end, ANSWERS,
                                 [("attn_out", la, None, None) for la in range(n_layers)], direction=direction)
    assert heads_only.raw == pytest.approx(as_attn_out.raw, abs=1e-4)  # z of all heads = attn_out, every layer


def test_one_unit_together_equals_the_single_unit_map(tiny_model):
    """A set of one unit is the map's cell (activation_patching's batched sweep)."""
    sweep = activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site="k")
    for layer, g in [(0, 1), (1, 0)]:
        one = patch_together(tiny_model, CLEAN, CORRUPTED, ANSWERS, [("k", layer, g, None)])
        assert one.value == pytest.approx(sweep.values[layer, g], abs=1e-4)


@pytest.mark.parametrize("unit,message", [
    (("o", 0, 0, None), "Unknown site 'o'"), (("z", 2, 0, None), "out of range"), (("k", 0, 2, None), "out of range"),
    (("z", 0, None, None), "is per head"), (("mlp_out", 0, 1, None), "has no heads"),
    (("embed", 0, None, None), "no layer or head"), (("z", 0, 0, 99), "Position 99"), (("z", 0, 0), "(site, layer"),
])
def test_bad_units_are_explained(tiny_model, unit, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        patch_together(tiny_model, CLEAN, CORRUPTED, ANSWERS, [unit])


# ---------------------------------------------------------------------------------------------
# Path patching


def path_patching_by_hand(model, pair, senders, receivers, site, direction, freeze_mlps):
    """Wang et al. 2022's construction written out: cache every z (and MLP output) of both runs, then
    one forward pass with all heads frozen but the senders (keeping the receivers' input), and one with
    the receivers' input replaced: the metric of that last pass, not normalised."""
    source, receive = source_and_receive(pair, direction)
    n = model.n_layers

    def cache(ids):
        got = {}
        names = [get_act_name("z", la) for la in range(n)] + [get_act_name("mlp_out", la) for la in range(n)]
        with torch.no_grad():
            model.bridge.run_with_hooks(
                torch.tensor([list(ids)]), return_type=None,
                fwd_hooks=[(nm, lambda t, hook, nm=nm: got.__setitem__(nm, t.clone())) for nm in names])
        return got

    src, rec = cache(source), cache(receive)

    def freeze(t, hook, layer):
        out = rec[get_act_name("z", layer)].clone()
        for la, h in senders:
            if la == layer:
                out[:, :, h] = src[get_act_name("z", layer)][:, :, h]
        return out

    hooks = [(get_act_name("z", la), lambda t, hook, la=la: freeze(t, hook, la)) for la in range(n)]
    if freeze_mlps:
        hooks += [(get_act_name("mlp_out", la), lambda t, hook, la=la: rec[get_act_name("mlp_out", la)])
                  for la in range(n)]
    kept = {}
    hooks += [(get_act_name(site, la), lambda t, hook, la=la: kept.__setitem__(la, t.clone())) for la in range(n)]
    with torch.no_grad():
        model.bridge.run_with_hooks(torch.tensor([list(receive)]), fwd_hooks=hooks, return_type=None)

    def receive_input(t, hook, layer):
        t = t.clone()
        for la, h in receivers:
            if la == layer:
                t[:, :, h] = kept[layer][:, :, h]
        return t

    patched = [(get_act_name(site, la), lambda t, hook, la=la: receive_input(t, hook, la)) for la in range(n)]
    m = metric(last_logits(model, receive, patched), pair.answers)
    return m


@pytest.mark.parametrize("site,senders,receivers,direction,freeze_mlps", [
    ("q", [(0, 1)], [(1, 2)], "denoise", False),
    ("q", [(0, 0), (0, 3)], [(1, 0), (1, 3)], "noise", False),
    ("k", [(0, 0), (0, 1), (0, 2), (0, 3)], [(1, 1)], "noise", True),
    ("v", [(0, 0), (0, 1), (0, 2), (0, 3)], [(1, 0), (1, 1)], "denoise", False),
    ("v", [(0, 2), (1, 1)], [(1, 0), (0, 1)], "noise", True),  # a sender after, a receiver before: no path
])
def test_path_patching_equals_the_construction_by_hand(tiny_model, site, senders, receivers, direction, freeze_mlps):
    got = path_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, senders, receivers, site=site, direction=direction,
                        freeze_mlps=freeze_mlps)
    expected = path_patching_by_hand(tiny_model, got.pair, senders, receivers, site, direction, freeze_mlps)
    # Raw metrics: the tiny random model's logit differences are ~0.01, so normalising multiplies
    # float32 rounding by ~100.
    assert got.raw == pytest.approx(expected, abs=2e-7)
    m_receive = got.corrupted if direction == "denoise" else got.clean
    assert abs(expected - m_receive) > 50 * 2e-7  # a real effect to get right
    assert got.value == pytest.approx((expected - got.corrupted) / (got.clean - got.corrupted), abs=1e-4)


def test_path_patching_is_not_activation_patching_of_the_receivers(tiny_model):
    """Every layer-0 head sending into every layer-1 query. In the last layer only the last position's
    query reaches the logits, and there both prompts have the same token: with layer 0's MLP recomputed
    from the senders' output that query is the source run's, so path patching equals patching the
    queries outright; with the MLP frozen to the receiving run it does not."""
    receivers = [(1, h) for h in range(tiny_model.n_heads)]
    senders = [(0, h) for h in range(tiny_model.n_heads)]
    frozen = path_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, senders, receivers, freeze_mlps=True)
    recomputed = path_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, senders, receivers)
    outright = patch_together(tiny_model, CLEAN, CORRUPTED, ANSWERS, [("q", 1, h, None) for h in range(4)])
    assert recomputed.value == pytest.approx(outright.value, abs=1e-5)
    assert abs(frozen.value - outright.value) > 1e-3


@pytest.mark.parametrize("kwargs,message", [
    ({"site": "z"}, "choose the site from q, k, v"), ({"senders": []}, "at least one sender"),
    ({"receivers": [(1, 2)], "site": "k"}, "out of range"), ({"senders": [(1, 0)], "receivers": [(0, 1), (1, 1)]},
                                                             "No receiver lies in a layer after a sender"),
])
def test_path_patching_settings_that_cannot_be_patched_are_explained(tiny_model, kwargs, message):
    args = {"senders": [(0, 0)], "receivers": [(1, 0)], **kwargs}
    with pytest.raises(InputError, match=message):
        path_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, args.pop("senders"), args.pop("receivers"), **args)


# ---------------------------------------------------------------------------------------------
# The embedded model


def test_ioi_pair_on_the_embedded_model(real_model):
    """An IOI-style name swap (Wang et al. 2022): the model prefers the indirect object in both
    prompts; exact patching equals a plain per-head loop; attribution ranks the heads alike."""
    pair = prompt_pair(real_model, CLEAN, CORRUPTED, ANSWERS)
    assert metric(last_logits(real_model, pair.clean_ids), pair.answers) > 2  # " Mary" over " John"
    assert metric(last_logits(real_model, pair.corrupted_ids), pair.answers) < -2  # " John" over " Mary"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = activation_patching(real_model, CLEAN, CORRUPTED, ANSWERS, site="z", attribution=True)
        layers = (0, 17, 23, 29)
        units = [(la, h, None) for la in layers for h in range(real_model.n_heads)]
        expected = brute_force(real_model, pair, "z", "denoise", units).reshape(len(layers), -1)
    finally:
        torch.set_num_threads(n)
    np.testing.assert_allclose(result.values[list(layers)], expected, atol=1e-3)
    (top, value), *_ = result.top_units(1)
    assert value > 0.3  # one head restores a third of the logit difference or more
    assert result.agreement.pearson > 0.9 and result.agreement.overlap >= 0.6
    assert result.top_units(1, attribution=True)[0][0] == top


def test_a_key_value_head_out_of_range_is_named_as_one(tiny_model):
    """k and v are patched per key-value head: the message counts those, not query heads."""
    with pytest.raises(InputError, match="key-value heads 0..1"):
        activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site="k", head=(0, 3))
    with pytest.raises(InputError, match="query heads 0..3"):
        activation_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, site="q", head=(0, 9))
    with pytest.raises(InputError, match="key-value heads 0..1"):
        path_patching(tiny_model, CLEAN, CORRUPTED, ANSWERS, [(0, 0)], [(1, 2)], site="v")


# The patching limit (#38 item 7): one limit, HEADSCOPE_MAX_PATCH_TOKENS, read when a pair is checked,
# and named by the message that refuses a pair over it.
LIMIT = "HEADSCOPE_MAX_PATCH_TOKENS"


def long_pair(model, n_tokens: int) -> tuple[str, str]:
    """The IOI pair, padded with " and" (one token each) to exactly ``n_tokens`` tokens per prompt."""
    pad = n_tokens - len(model.input_ids(CLEAN))
    clean = CLEAN.replace(" store,", " store" + " and" * pad + ",")
    corrupted = CORRUPTED.replace(" store,", " store" + " and" * pad + ",")
    assert len(model.input_ids(clean)) == len(model.input_ids(corrupted)) == n_tokens
    return clean, corrupted


@pytest.fixture(scope="module")
def long_model(make_tiny_model):
    """A tiny model whose context (4,096) holds a 2,101-token pair."""
    return make_tiny_model(max_positions=4096, name="tiny-llama-long")


def test_a_lowered_patching_limit_refuses_a_61_token_pair_and_names_its_variable(long_model, monkeypatch):
    clean, corrupted = long_pair(long_model, 61)
    monkeypatch.setenv(LIMIT, "16")
    for check in (lambda: prompt_pair(long_model, clean, corrupted, ANSWERS),
                  lambda: activation_patching(long_model, clean, corrupted, ANSWERS, site="z"),
                  lambda: path_patching(long_model, clean, corrupted, ANSWERS, [(0, 0)], [(1, 1)])):
        with pytest.raises(InputError) as refused:
            check()
        message = str(refused.value)
        assert "61 tokens" in message and "the limit is 16" in message and f"set {LIMIT}" in message, message
        assert "HEADSCOPE_MAX_TOKENS" not in message
    monkeypatch.setenv(LIMIT, "61")  # at the limit: admitted
    assert prompt_pair(long_model, clean, corrupted, ANSWERS).n_tokens == 61


def test_a_raised_patching_limit_admits_a_2101_token_pair(long_model, monkeypatch):
    clean, corrupted = long_pair(long_model, 2101)
    monkeypatch.delenv(LIMIT, raising=False)
    with pytest.raises(InputError, match=rf"2,101 tokens.*the limit is 2,048; set {LIMIT} to change it"):
        prompt_pair(long_model, clean, corrupted, ANSWERS)  # the default
    monkeypatch.setenv(LIMIT, "5000")
    pair = prompt_pair(long_model, clean, corrupted, ANSWERS)
    assert pair.n_tokens == 2101 and pair.differ == (2101 - 5,)


@pytest.mark.parametrize("value", ["abc", "-5", "0", "1e3", "", "16.5", "0x10", "١٦"])
def test_a_malformed_patching_limit_is_the_default(long_model, monkeypatch, value):
    """A value that is not a positive whole number in ASCII digits is ignored: the default holds."""
    clean, corrupted = long_pair(long_model, 61)
    monkeypatch.setenv(LIMIT, value)
    assert prompt_pair(long_model, clean, corrupted, ANSWERS).n_tokens == 61
