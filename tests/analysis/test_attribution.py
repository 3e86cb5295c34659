"""Token attribution and its faithfulness (Abnar & Zuidema 2020) against independent references.

The leave-one-out importance is checked against a one-token-at-a-time loop through the Hugging Face
model's ``inputs_embeds`` (not the bridge's hook); input×gradient against autograd through that
same independent path and against central finite differences on a float64 copy of the tiny model.
"""

import numpy as np
import pytest
import torch

from headscope.analysis.attribution import (
    COPY_SET,
    EVAL_SET,
    METHODS,
    Attribution,
    EvalItem,
    Faithfulness,
    ablation_baseline,
    ablation_importance,
    attribute,
    evaluate,
    input_x_gradient,
    load_eval_set,
    spearman,
    token_relevance,
)
from headscope.analysis.capture import capture
from headscope.analysis.errors import InputError
from headscope.analysis.flow import attention_flow, flow_reference_networkx
from headscope.analysis.rollout import rollout
from tests.conftest import tiny_hf_model

TEXT = "The keys to the old wooden cabinet in the kitchen"


def _embeddings(model, ids):
    with torch.no_grad():
        return model.hf_model.get_input_embeddings()(torch.tensor([ids])).detach()


def _logprob(model, embeds, target):
    with torch.no_grad():
        logits = model.hf_model(inputs_embeds=embeds).logits
    return torch.log_softmax(logits[0, -1].double(), dim=-1)[target].item()


@pytest.fixture(scope="module")
def tiny_attribution(tiny_model):
    return attribute(tiny_model, TEXT)


# ---------------------------------------------------------------------------------------------
# Leave-one-out ablation


@pytest.mark.parametrize("ablation", ["zero", "mean"])
def test_ablation_importance_equals_one_at_a_time_loop(tiny_model, ablation):
    ids = tiny_model.encode("The keys to the cabinet")
    t = len(ids) - 1
    target = 1234
    got, base = ablation_importance(tiny_model, ids, t, target, ablation=ablation)

    embeds = _embeddings(tiny_model, ids)
    weight = tiny_model.hf_model.get_input_embeddings().weight.detach()
    replacement = torch.zeros(weight.shape[1]) if ablation == "zero" else weight.mean(dim=0)
    expected_base = _logprob(tiny_model, embeds, target)
    expected = []
    for j in range(len(ids)):
        ablated = embeds.clone()
        ablated[0, j] = replacement
        expected.append(expected_base - _logprob(tiny_model, ablated, target))
    assert base == pytest.approx(expected_base, abs=1e-5)
    np.testing.assert_allclose(got, expected, atol=2e-5)
    assert got.shape == (len(ids),)


def test_ablation_importance_does_not_depend_on_batching(tiny_model):
    ids = tiny_model.encode(TEXT)
    whole, _ = ablation_importance(tiny_model, ids, len(ids) - 1, 99)
    chunked, _ = ablation_importance(tiny_model, ids, len(ids) - 1, 99, batch_size=3)
    np.testing.assert_allclose(chunked, whole, atol=1e-5)


def test_mean_baseline_is_the_mean_embedding(tiny_model):
    weight = tiny_model.hf_model.get_input_embeddings().weight.detach()
    np.testing.assert_allclose(ablation_baseline(tiny_model, "mean"), weight.mean(dim=0), atol=1e-7)
    assert not ablation_baseline(tiny_model, "zero").any()


# ---------------------------------------------------------------------------------------------
# Input×gradient


def test_input_x_gradient_matches_autograd_through_inputs_embeds(tiny_model):
    ids = tiny_model.encode(TEXT)
    target = 4321
    norm, signed, logprob = input_x_gradient(tiny_model, ids, len(ids) - 1, target)

    embeds = _embeddings(tiny_model, ids).requires_grad_(True)
    logits = tiny_model.hf_model(inputs_embeds=embeds).logits
    f = torch.log_softmax(logits[0, -1], dim=-1)[target]
    f.backward()
    product = (embeds * embeds.grad)[0].detach().double()
    tiny_model.hf_model.zero_grad(set_to_none=True)
    np.testing.assert_allclose(norm, product.norm(dim=-1), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(signed, product.sum(dim=-1), rtol=1e-5, atol=1e-8)
    assert logprob == pytest.approx(f.item(), abs=1e-5)
    # autograd.grad leaves no gradient behind in the model
    assert all(p.grad is None for p in tiny_model.bridge.parameters())
    with torch.inference_mode():  # a caller's inference mode does not break the gradient
        again, _, _ = input_x_gradient(tiny_model, ids, len(ids) - 1, target)
    np.testing.assert_allclose(again, norm, rtol=1e-6)


def test_input_x_gradient_sum_matches_finite_differences(tiny_model):
    """e_j · ∂f/∂e_j = d/dε f(…, (1 + ε)·e_j, …) at ε = 0, by a five-point stencil in float64."""
    from headscope.analysis.models import wrap_model

    hf = tiny_hf_model(len(tiny_model.tokenizer), seed=1).double()
    model = wrap_model(hf, tiny_model.tokenizer, name="tiny-float64", digest="tiny-float64")
    ids = model.encode(TEXT)[:7]
    target = 777
    _, signed, _ = input_x_gradient(model, ids, len(ids) - 1, target)

    embeds = _embeddings(model, ids)[0]
    eps = 1e-2  # eager attention runs its softmax in float32: smaller steps drown in rounding
    steps = torch.tensor([2 * eps, eps, -eps, -2 * eps], dtype=embeds.dtype)
    weights = torch.tensor([-1.0, 8.0, -8.0, 1.0], dtype=embeds.dtype) / (12 * eps)
    # One batch of every (position, step) copy with e_j scaled by 1 + step.
    scale = torch.ones(len(ids), len(steps), len(ids), 1, dtype=embeds.dtype)
    scale[torch.arange(len(ids)), :, torch.arange(len(ids))] += steps[:, None]
    batch = (scale * embeds).reshape(-1, len(ids), embeds.shape[-1])
    with torch.no_grad():
        logits = model.hf_model(inputs_embeds=batch).logits[:, -1]
    f = torch.log_softmax(logits.double(), dim=-1)[:, target].reshape(len(ids), len(steps))
    np.testing.assert_allclose(signed, (f * weights).sum(dim=1), rtol=1e-3, atol=2e-6)


# ---------------------------------------------------------------------------------------------
# attribute(): wiring of every method


def test_attribute_scores_cover_positions_up_to_the_target(tiny_model, tiny_attribution):
    a = tiny_attribution
    n = len(tiny_model.encode(TEXT))
    assert a.position == n - 1
    assert set(a.scores) == set(METHODS) | {"ablation"}
    for scores in a.scores.values():
        assert scores.shape == (n,) and np.isfinite(scores).all()
    assert a.scores["attention"].sum() == pytest.approx(1.0, abs=1e-5)
    assert a.scores["rollout"].sum() == pytest.approx(1.0, abs=1e-9)
    assert (a.scores["ixg_norm"] >= 0).all()

    run = capture(tiny_model, a.token_ids, pattern_dtype="float32")
    np.testing.assert_allclose(a.scores["attention"], run.patterns[-1].mean(axis=0)[-1], atol=1e-6)
    np.testing.assert_allclose(a.scores["rollout"], rollout(run.patterns)[-1], atol=1e-12)
    np.testing.assert_allclose(a.scores["flow"], attention_flow(run.patterns), atol=1e-12)


def test_default_target_is_the_top_prediction(tiny_model, tiny_attribution):
    run = capture(tiny_model, TEXT, pattern_dtype="float32")
    assert tiny_attribution.target_id == int(run.top_ids[-1, 0])
    assert tiny_attribution.target_logprob == pytest.approx(np.log(run.top_probs[-1, 0]), abs=1e-4)


def test_an_earlier_position_ignores_the_later_tokens(tiny_model):
    ids = tiny_model.encode(TEXT)
    early = attribute(tiny_model, ids, position=4, target=" are")
    truncated = attribute(tiny_model, ids[:5], target=" are")
    assert early.position == 4 and early.token_ids == ids
    assert early.target_id == tiny_model.encode(" are")[0]
    for method, scores in truncated.scores.items():
        np.testing.assert_allclose(early.scores[method], scores, atol=1e-5, err_msg=method)
    negative = attribute(tiny_model, ids, position=-len(ids) + 4, target=" are")
    np.testing.assert_allclose(negative.scores["ablation"], early.scores["ablation"], atol=1e-6)


# ---------------------------------------------------------------------------------------------
# token_relevance(): the Flow page's numbers, against a hand-written reference


def _causal_patterns(rng, layers=3, heads=4, n=7):
    logits = rng.normal(size=(layers, heads, n, n)) * 2
    logits[..., np.triu_indices(n, 1)[0], np.triu_indices(n, 1)[1]] = -np.inf
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _fused_step(layer, fusion, sink, residual):
    """Â of one layer written out: fuse heads, zero the sink column, renormalise, add the identity."""
    a = {"mean": np.mean, "max": np.max, "min": np.min}[fusion](layer, axis=0)
    a = np.tril(a)
    if sink:
        a[:, 0] = 0.0
    rows = a.sum(1, keepdims=True)
    a = np.where(rows > 0, a / np.where(rows > 0, rows, 1), np.eye(len(a)))
    return residual * np.eye(len(a)) + (1 - residual) * a


@pytest.mark.parametrize("drop_sink", [False, True])
@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
def test_token_relevance_is_the_written_out_definition(fusion, drop_sink):
    patterns = _causal_patterns(np.random.default_rng(3))
    t = 5
    got = token_relevance(patterns, t, fusion=fusion, drop_sinks=(0,) if drop_sink else ())
    raw = _fused_step(patterns[-1], fusion, drop_sink, 0.0)[t, : t + 1]
    np.testing.assert_allclose(got.scores["attention"], raw, atol=1e-12)
    product = np.eye(patterns.shape[-1])
    for layer in range(patterns.shape[0]):
        product = _fused_step(patterns[layer], fusion, drop_sink, 0.5) @ product
        np.testing.assert_allclose(got.rollout_layers[layer], product[t, : t + 1], atol=1e-12)
    np.testing.assert_allclose(got.scores["rollout"], product[t, : t + 1], atol=1e-12)
    reference = flow_reference_networkx(patterns, target=t, fusion=fusion, drop_sinks=(0,) if drop_sink else ())
    np.testing.assert_allclose(got.scores["flow"], reference[: t + 1], atol=1e-9)
    if drop_sink:
        assert got.scores["attention"][0] == got.scores["rollout"][0] == 0.0


def test_attribute_scores_the_options_it_is_given(tiny_model):
    """The faithfulness protocol's attention methods are token_relevance's, options included."""
    ids = tiny_model.encode(TEXT)
    a = attribute(tiny_model, ids, position=6, fusion="max", drop_sinks=(0,))
    run = capture(tiny_model, ids[:7], pattern_dtype="float32")
    expected = token_relevance(run.patterns, 6, fusion="max", drop_sinks=(0,))
    for method in ("attention", "rollout", "flow"):
        np.testing.assert_allclose(a.scores[method], expected.scores[method], atol=1e-12, err_msg=method)
    assert a.scores["attention"][0] == 0.0


def test_flow_past_its_limit_is_left_out_with_the_reason():
    patterns = _causal_patterns(np.random.default_rng(0), n=6)
    got = token_relevance(patterns, 4, flow_limit=5)
    assert set(got.scores) == {"attention", "rollout"}
    assert "limited to 5 tokens" in got.unavailable["flow"] and "HEADSCOPE_MAX_FLOW_TOKENS" in got.unavailable["flow"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target": 7}, r"positions 0\.\.6"),
        ({"target": 2.0}, "out of range"),
        ({"target": 3, "fusion": "median"}, "choose one of mean, max, min"),
        ({"target": 3, "drop_sinks": (9,)}, "drop_sinks"),
        ({"target": 3, "raw_layer": 3}, "raw_layer"),
        ({"target": 3, "residual": -0.1}, "residual"),
    ],
)
def test_token_relevance_bad_options_are_input_errors(kwargs, message):
    with pytest.raises(InputError, match=message):
        token_relevance(_causal_patterns(np.random.default_rng(1)), **kwargs)


# ---------------------------------------------------------------------------------------------
# Spearman and summaries


def test_spearman_matches_the_rank_formula():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b = rng.normal(size=9), rng.normal(size=9)
        ra, rb = a.argsort().argsort(), b.argsort().argsort()
        d2 = ((ra - rb) ** 2).sum()
        assert spearman(a, b) == pytest.approx(1 - 6 * d2 / (9 * (81 - 1)), abs=1e-12)
        assert -1.0 <= spearman(a, b) <= 1.0
    x = np.arange(6.0)
    assert spearman(x, x**3) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)


def test_spearman_is_nan_where_undefined():
    assert np.isnan(spearman([1.0, 2.0], [2.0, 1.0]))
    assert np.isnan(spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="equal length"):
        spearman([1.0, 2.0, 3.0], [1.0, 2.0])


def _fake(scores, ablation):
    n = len(ablation)
    return Attribution(
        token_ids=list(range(n)), tokens=[str(i) for i in range(n)], position=n - 1, target_id=0,
        target_token="x", target_logprob=-1.0, ablation="zero",
        scores={"a": np.asarray(scores, float), "ablation": np.asarray(ablation, float)},
    )


def test_correlations_exclude_positions_and_use_magnitude():
    a = _fake([9.0, 1.0, 2.0, 3.0], [5.0, -3.0, 2.0, 1.0])
    assert a.correlations(["a"])["a"] == pytest.approx(spearman([9, 1, 2, 3], [5, -3, 2, 1]))
    assert a.correlations(["a"], exclude=(0,))["a"] == pytest.approx(spearman([1, 2, 3], [-3, 2, 1]))
    assert a.correlations(["a"], magnitude=True)["a"] == pytest.approx(spearman([9, 1, 2, 3], [5, 3, 2, 1]))


def test_summary_is_mean_and_spread_over_defined_inputs():
    attributions = [
        _fake([1, 2, 3, 4], [1, 2, 3, 4]),  # ρ = 1
        _fake([1, 2, 3, 4], [4, 3, 2, 1]),  # ρ = −1
        _fake([1, 2, 3, 4], [1, 2, 4, 3]),  # ρ = 0.8
        _fake([1, 1, 1, 1], [1, 2, 3, 4]),  # undefined: left out
    ]
    result = Faithfulness(items=[], attributions=attributions, seconds=[0.0] * 4)
    table = result.correlations(["a"])
    assert table.shape == (4, 1) and np.isnan(table[3, 0])
    s = result.summary(["a"])["a"]
    assert s.n == 3
    assert s.mean == pytest.approx(0.8 / 3)
    assert s.std == pytest.approx(np.std([1, -1, 0.8], ddof=1))
    assert s.median == pytest.approx(0.8)


def test_evaluate_runs_every_item(tiny_model):
    items = [EvalItem("a", "t", "The capital of France is", " Paris"), EvalItem("b", "t", TEXT, " are")]
    result = evaluate(tiny_model, items)
    assert [a.target_token for a in result.attributions] == ["·Paris", "·are"]
    assert len(result.seconds) == 2
    summary = result.summary()
    assert set(summary) == set(METHODS)
    assert all(-1 <= s.mean <= 1 and s.n == 2 for s in summary.values())


# ---------------------------------------------------------------------------------------------
# Errors a user can cause


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"text_or_ids": ""}, "empty"),
        ({"text_or_ids": "   "}, "empty"),
        ({"text_or_ids": []}, "no tokens"),
        ({"text_or_ids": "word " * 200}, "limited to 128 tokens"),
        ({"text_or_ids": TEXT, "max_tokens": 4}, "limited to 4 tokens"),
        ({"text_or_ids": TEXT, "position": 10}, r"0 \.\. 9"),
        ({"text_or_ids": TEXT, "position": -11}, "outside the input"),
        ({"text_or_ids": TEXT, "position": 2.5}, "whole number"),
        ({"text_or_ids": TEXT, "target": " Parisianism"}, "exactly one token"),
        ({"text_or_ids": TEXT, "target": 10**9}, "outside the vocabulary"),
        ({"text_or_ids": [10**9]}, "outside the vocabulary"),
        ({"text_or_ids": TEXT, "ablation": "noise"}, "ablation must be one of"),
        ({"text_or_ids": TEXT, "raw_layer": 2}, "raw_layer"),
        ({"text_or_ids": TEXT, "drop_sinks": (40,)}, "drop_sinks"),
        ({"text_or_ids": TEXT, "residual": 1.5}, "residual"),
    ],
)
def test_bad_input_is_an_input_error(tiny_model, kwargs, message):
    text = kwargs.pop("text_or_ids")
    with pytest.raises(InputError, match=message):
        attribute(tiny_model, text, **kwargs)


def test_built_in_eval_set_is_well_formed():
    items = load_eval_set()
    assert EVAL_SET.is_file()
    assert 20 <= len(items) <= 40
    assert len({i.id for i in items}) == len(items)
    assert {i.kind for i in items} == {"agreement", "factual", "context"}
    assert all(i.text.strip() and i.target for i in items)


def test_copy_set_answers_are_words_the_prompt_already_contains():
    items = load_eval_set(COPY_SET)
    assert len(items) >= 15 and len({i.id for i in items}) == len(items)
    assert {i.kind for i in items} == {"name", "copy"}
    assert all(i.target.strip() in i.text for i in items)


# ---------------------------------------------------------------------------------------------
# The embedded model


@pytest.mark.integration
@pytest.mark.parametrize("path", [EVAL_SET, COPY_SET], ids=["eval_set", "copy_set"])
def test_eval_set_targets_are_the_models_top_prediction(real_model, path):
    items = load_eval_set(path)
    ids = [real_model.encode(i.text) for i in items]
    targets = [real_model.encode(i.target) for i in items]
    assert all(len(t) == 1 for t in targets), "every target must be one token"
    top = {}
    for length in sorted(set(map(len, ids))):
        group = [k for k, row in enumerate(ids) if len(row) == length]
        with torch.inference_mode():
            logits = real_model.hf_model(input_ids=torch.tensor([ids[k] for k in group]), logits_to_keep=1).logits
        top.update(zip(group, logits[:, -1].argmax(dim=-1).tolist(), strict=True))
    top = [top[k] for k in range(len(items))]
    wrong = [i.id for i, t, y in zip(items, targets, top, strict=True) if t[0] != y]
    assert not wrong, f"SmolLM2-135M no longer predicts the target of {wrong}"


@pytest.mark.integration
def test_real_model_paris_depends_on_france(real_model):
    a = attribute(real_model, "The capital of France is")
    assert a.target_token == "·Paris"
    assert a.target_logprob > np.log(0.5)
    # Removing " France" hurts " Paris" most; gradients agree on the sign of every big effect.
    assert a.tokens[int(np.argmax(a.scores["ablation"]))] == "·France"
    assert (a.scores["ablation"] > 0).all()
    rho = a.correlations()
    assert all(-1 <= v <= 1 for v in rho.values())


@pytest.mark.integration
@pytest.mark.parametrize(("text", "right", "wrong"), [("The keys to the cabinet", " are", " is"),
                                                     ("The key to the cabinets", " is", " are")])
def test_real_model_agreement_needs_the_subject(real_model, text, right, wrong):
    ids = real_model.encode(text)
    assert real_model.token_strings(ids)[1] in ("·keys", "·key")
    (right_id,), (wrong_id,) = real_model.encode(right), real_model.encode(wrong)
    for ablation in ("zero", "mean"):
        helps, _ = ablation_importance(real_model, ids, len(ids) - 1, right_id, ablation=ablation)
        hurts, _ = ablation_importance(real_model, ids, len(ids) - 1, wrong_id, ablation=ablation)
        # Removing the subject noun costs the verb of its number more than the other verb.
        assert helps[1] > hurts[1] + 0.5, ablation
