"""The Ablation page's and ``headscope ablate``'s one action (:func:`headscope.analysis.ablation_effects.apply`)
on a tiny random Llama: its losses and Δloss against a plain Hugging Face forward pass that removes the
heads by hand (no TransformerLens, no hooks of headscope's), its references stored and reused, and the
inputs it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headscope.analysis.ablation_effects import (
    CONTINUATION_TOKENS,
    AppliedAblation,
    apply,
    builtin_reference,
    effects_on,
    prepare,
)
from headscope.analysis.capture import capture
from headscope.analysis.errors import InputError
from tests.conftest import tiny_hf_model

TEXT = "When Mary and John went to the store, John gave a drink to Mary."
SOURCE = "When Anna and Peter went to the park, Peter gave a ball to Anna."
REFERENCE = [[1, 504, 2843, 314, 260], [1, 1680, 7205, 28, 30, 2291, 30, 16], [1, 4000, 12, 19, 3333]]


@pytest.fixture(scope="module")
def hf(tiny_model):
    """The tiny model's own weights in a plain Hugging Face Llama (the same seed), never wrapped."""
    return tiny_hf_model(len(tiny_model.tokenizer)).eval()


@pytest.fixture(scope="module")
def run(tiny_model):
    return capture(tiny_model, TEXT, pattern_dtype="float32")


def _forward(hf, ids, replace=None):
    """Logits of a plain forward pass; ``replace[(layer, head)](z) -> z'`` rewrites that head's output
    before the output projection (the input of ``o_proj``, heads side by side)."""
    d_head = hf.config.hidden_size // hf.config.num_attention_heads
    handles = []
    for layer in {la for la, _ in replace or {}}:
        def pre(module, args, layer=layer):
            x = args[0].clone()
            for (la, h), fn in replace.items():
                if la == layer:
                    x[..., h * d_head:(h + 1) * d_head] = fn(x[..., h * d_head:(h + 1) * d_head])
            return (x,)
        handles.append(hf.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(pre))
    try:
        with torch.inference_mode():
            return hf(torch.tensor([list(ids)])).logits[0].double()
    finally:
        for handle in handles:
            handle.remove()


def _mean_loss(logits, ids):
    """``mean_{i≥1} −log p(t_i | t_<i)``."""
    logprobs = torch.log_softmax(logits[:-1], -1)
    return float(-logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean())


def test_d_loss_is_the_loss_after_minus_the_loss_before_of_a_plain_forward_pass(tiny_model, hf, run):
    applied = apply(tiny_model, run, "0.1, 1.2,1.2", "zero")
    ids = run.token_ids
    before = _mean_loss(_forward(hf, ids), ids)
    zero = {(0, 1): torch.zeros_like, (1, 2): torch.zeros_like}
    after = _mean_loss(_forward(hf, ids, zero), ids)
    assert applied.spec.heads == ((0, 1), (1, 2))
    assert applied.loss_clean == pytest.approx(before, abs=1e-5)
    assert applied.loss_ablated == pytest.approx(after, abs=1e-5)
    assert applied.d_loss == pytest.approx(after - before, abs=1e-5) and abs(after - before) > 1e-4
    # the next token the numbers follow is the clean model's own prediction after the last token
    clean, ablated = torch.softmax(_forward(hf, ids)[-1], -1), torch.softmax(_forward(hf, ids, zero)[-1], -1)
    target = int(run.top_ids[-1, 0])
    assert target == int(clean.argmax()) and applied.effects.target_token == target
    assert applied.p_next_clean == pytest.approx(float(clean[target]), abs=1e-5)
    assert applied.d_p_next == pytest.approx(float(ablated[target] - clean[target]), abs=1e-5)
    assert len(applied.effects.continuation_clean) == len(applied.effects.continuation_ablated) == CONTINUATION_TOKENS


def test_mean_ablation_replaces_heads_by_their_mean_over_the_reference_and_stores_it(tiny_model, hf, run, store):
    applied = apply(tiny_model, run, [(1, 0)], "mean", reference=REFERENCE, max_new_tokens=0, store=store)
    d_head = hf.config.hidden_size // hf.config.num_attention_heads
    seen = []  # the head's z at every reference position, read from o_proj's input
    hook = hf.model.layers[1].self_attn.o_proj.register_forward_pre_hook(
        lambda module, args: seen.append(args[0][0, :, 0:d_head].double()))
    try:
        for ids in REFERENCE:
            _forward(hf, ids)
    finally:
        hook.remove()
    mean = torch.cat(seen).mean(0)
    after = _mean_loss(_forward(hf, run.token_ids, {(1, 0): lambda z: mean.to(z.dtype).expand_as(z)}), run.token_ids)
    assert applied.loss_ablated == pytest.approx(after, abs=1e-5)
    assert store.get(applied.means_key).kind == "head_means" and applied.source_key is None
    # asked again: the stored means, not computed again
    again = prepare(tiny_model, "1.0", "mean", reference=REFERENCE, store=store)
    assert again.means_key == applied.means_key and len(store.list(kind="head_means")) == 1


def test_the_default_reference_is_the_builtin_sentences(tiny_model, run, store):
    assert len(builtin_reference()) == 100 and not any(t.startswith("#") for t in builtin_reference())
    seen = []
    prepared = prepare(tiny_model, "0.0", "mean", store=store, progress=seen.append)
    assert prepared.spec.means.n_runs == 100 and seen[-1] == 1.0


def test_resample_from_a_text_stores_the_source_run_and_equals_the_same_ids(tiny_model, run, store):
    from_text = apply(tiny_model, run, "1.3", "resample", source=SOURCE, max_new_tokens=2, store=store)
    source_run = store.get(from_text.source_key)
    assert source_run is not None and source_run.kind == "run"
    from_ids = apply(tiny_model, run, "1.3", "resample", source=list(from_text.spec.source_ids), max_new_tokens=2)
    assert from_ids.source_key is None and from_ids.spec == from_text.spec
    np.testing.assert_array_equal(from_ids.effects.loss_ablated, from_text.effects.loss_ablated)
    assert from_text.d_loss != 0


def test_progress_starts_at_zero_after_the_reference_and_ends_at_one(tiny_model, run):
    seen = []
    apply(tiny_model, run, "0.0", "uniform", max_new_tokens=1, progress=seen.append)
    assert seen[0] == 0.0 and seen[-1] == 1.0 and seen == sorted(seen)


def test_effects_on_a_prepared_spec_are_apply_s(tiny_model, run):
    prepared = prepare(tiny_model, "kv:1.0", "first_token")
    assert prepared.spec.heads == ((1, 0), (1, 1))  # the key-value group's query heads
    a, b = effects_on(tiny_model, run, prepared, max_new_tokens=0), apply(tiny_model, run, "kv:1.0", "first_token",
                                                                          max_new_tokens=0)
    assert isinstance(a, AppliedAblation) and a.d_loss == b.d_loss


@pytest.mark.parametrize("heads, method, kw, words", [
    ("0.1", "bogus", {}, "Unknown ablation method"),
    ("0.1", None, {}, "Unknown ablation method"),
    ("", "zero", {}, "No heads given"),
    ([], "zero", {}, "No heads to ablate"),
    ("9.0", "zero", {}, "out of range"),
    ([(0, 99)], "zero", {}, "out of range"),
    ([(0.5, 1)], "zero", {}, "whole numbers"),
    ([(True, 0)], "zero", {}, "whole numbers"),
    ([(0,)], "zero", {}, "as text"),
    (42, "zero", {}, "as text"),
    ("0.1", "zero", {"source": SOURCE}, "only by resample"),
    ("0.1", "uniform", {"reference": ["a text"]}, "only by mean"),
    ("0.1", "resample", {}, "needs a source input"),
    ("0.1", "resample", {"source": "  \n "}, "needs a source input"),
    ("0.1", "resample", {"source": []}, "needs a source input"),
    ("0.1", "resample", {"source": [1, 2.5]}, "whole numbers"),
    ("0.1", "resample", {"source": [1, True]}, "whole numbers"),
    ("0.1", "resample", {"source": [1, -3]}, "outside the vocabulary"),
    ("0.1", "resample", {"source": [1, 10**9]}, "outside the vocabulary"),
    ("0.1", "resample", {"source": 7}, "text or as a list"),
    ("0.1", "mean", {"reference": "one text, not a list"}, "list of texts"),
    ("0.1", "mean", {"reference": []}, "empty"),
])
def test_what_apply_refuses_it_explains_before_running_the_text(tiny_model, run, heads, method, kw, words):
    with pytest.raises(InputError, match=words):
        apply(tiny_model, run, heads, method, max_new_tokens=0, **kw)


def test_means_of_another_model_are_refused(tiny_model, make_tiny_model, run):
    other = make_tiny_model(seed=3, name="tiny-other")
    means = prepare(other, "0.0", "mean", reference=REFERENCE).spec.means
    with pytest.raises(InputError, match="another model"):
        apply(tiny_model, run, "0.0", "mean", means=means, max_new_tokens=0)
