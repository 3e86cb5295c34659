"""Direct logit attribution (Elhage et al. 2021; Wang et al. 2022): the components add up to the model's own
logit difference in every family, per-head values equal an independent plain-hook computation on a fresh
Hugging Face copy of the model, and the embedded model."""

import numpy as np
import pytest
import torch

from headscope.analysis.errors import InputError
from headscope.analysis.logit_attribution import direct_logit_attribution
from headscope.analysis.models import wrap_model
from headscope.analysis.residual_components import capture_components
from tests.analysis.circuit_reference import reference_head_dla
from tests.tiny_families import FAMILIES, REFUSED, tiny_family_model

IDS = [1, 5, 9, 200, 7, 8, 9, 10, 300, 301, 7, 8]
ANSWER, WRONG = 9, 300


def _wrapped(family, tokenizer, seed=0):
    hf = tiny_family_model(family, len(tokenizer), seed=seed)
    return wrap_model(hf, tokenizer, name=f"tiny-{family}", digest=f"tiny-{family}-seed{seed}")


def _own_logit_diff(family, tokenizer, ids, seed=0):
    """The logit difference of a fresh, unwrapped copy of the same tiny model (before any final soft-capping)."""
    hf = tiny_family_model(family, len(tokenizer), seed=seed)
    if getattr(hf.config, "final_logit_softcapping", None):
        hf.config.final_logit_softcapping = None
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1].double()
    return float(logits[ANSWER] - logits[WRONG])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_components_add_up_to_the_models_logit_difference_in_every_family(family, embedded_tokenizer):
    model = _wrapped(family, embedded_tokenizer)
    result = direct_logit_attribution(model, IDS, ANSWER, WRONG)
    own = _own_logit_diff(family, embedded_tokenizer, IDS)
    assert abs(result.logit_diff - own) <= 1e-4 * abs(own)
    assert abs(result.values.sum() - own) <= 1e-4 * abs(own)
    assert result.heads().shape == (model.n_layers, model.n_heads)
    assert result.names[:2] == ["embed", "0.0"] and result.names[-1] == "bias"
    assert result.mlps().shape == (model.n_layers,) and result.value(f"mlp.{model.n_layers - 1}") == result.mlps()[-1]


def test_per_head_values_equal_a_plain_hook_reference(embedded_tokenizer):
    model = _wrapped("llama", embedded_tokenizer, seed=3)
    result = direct_logit_attribution(model, IDS, ANSWER, WRONG)
    reference, own = reference_head_dla(tiny_family_model("llama", len(embedded_tokenizer), seed=3), IDS, ANSWER, WRONG)
    np.testing.assert_allclose(result.heads(), reference.numpy(), rtol=1e-5, atol=1e-6 * abs(own))
    assert abs(result.logit_diff - own) <= 1e-5 * abs(own)


def test_swapping_the_answers_negates_every_value(embedded_tokenizer):
    model = _wrapped("qwen2", embedded_tokenizer)
    one = direct_logit_attribution(model, IDS, ANSWER, WRONG)
    other = direct_logit_attribution(model, IDS, WRONG, ANSWER)
    np.testing.assert_allclose(one.values, -other.values, rtol=1e-9, atol=1e-12)
    same = direct_logit_attribution(model, IDS, ANSWER, ANSWER)
    assert np.abs(same.values).max() < 1e-9 and same.logit_diff == 0.0


def test_a_capture_is_reused_and_an_earlier_position_is_explained(embedded_tokenizer):
    model = _wrapped("gemma2", embedded_tokenizer)
    capture = capture_components(model, IDS, [4, len(IDS) - 1])
    last = direct_logit_attribution(model, IDS, ANSWER, WRONG, capture=capture)
    early = direct_logit_attribution(model, IDS, ANSWER, WRONG, position=4, capture=capture)
    assert last.position == len(IDS) - 1 and early.position == 4
    assert abs(early.values.sum() - early.logit_diff) <= 1e-4 * abs(early.logit_diff)
    assert early.logit_diff != pytest.approx(last.logit_diff)


@pytest.mark.parametrize("ids, answer, wrong, position, message", [
    ([], 1, 2, None, "empty"),
    (IDS, -1, 2, None, "vocabulary"),
    (IDS, 1, 10**9, None, "vocabulary"),
    (IDS, True, 2, None, "vocabulary"),
    (IDS, 1.5, 2, None, "vocabulary"),
    (IDS, "9", 2, None, "vocabulary"),
    (IDS, 1, 2, len(IDS), "outside the text"),
    (IDS, 1, 2, -1, "outside the text"),
    ([1, -4, 3], 1, 2, None, "vocabulary"),
    ([1, None, 3], 1, 2, None, "whole numbers"),
    ([1, 2.5, 3], 1, 2, None, "whole numbers"),
    ([1, "2", 3], 1, 2, None, "whole numbers"),
])
def test_hostile_inputs_are_refused_with_a_message(ids, answer, wrong, position, message, embedded_tokenizer):
    model = _wrapped("llama", embedded_tokenizer)
    with pytest.raises(InputError, match=message):
        direct_logit_attribution(model, ids, answer, wrong, position=position)


def test_a_text_over_the_limit_is_refused(embedded_tokenizer, monkeypatch):
    monkeypatch.setenv("HEADSCOPE_MAX_TOKENS", "8")
    with pytest.raises(InputError, match="HEADSCOPE_MAX_TOKENS"):
        direct_logit_attribution(_wrapped("llama", embedded_tokenizer), IDS, ANSWER, WRONG)


@pytest.mark.parametrize("family", list(REFUSED))
def test_a_family_the_decomposition_does_not_know_is_refused(family, embedded_tokenizer):
    with pytest.raises(InputError, match="statistics mode"):
        direct_logit_attribution(_wrapped(family, embedded_tokenizer), IDS, ANSWER, WRONG)


def test_the_embedded_model_adds_up_and_matches_the_reference(real_model):
    from transformers import AutoModelForCausalLM

    from headscope.analysis.models import converted_gguf, embedded_gguf

    ids = real_model.input_ids("When Mary and John went to the store, John gave a drink to")
    answer, wrong = real_model.encode(" Mary")[0], real_model.encode(" John")[0]
    result = direct_logit_attribution(real_model, ids, answer, wrong)
    folder, _ = converted_gguf(embedded_gguf())
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    reference, own = reference_head_dla(hf, ids, answer, wrong)
    assert own > 0  # the model prefers the indirect object
    assert abs(result.values.sum() - own) <= 1e-4 * abs(own)
    assert abs(result.logit_diff - own) <= 1e-4 * abs(own)
    np.testing.assert_allclose(result.heads(), reference.numpy(), rtol=1e-4, atol=1e-5 * abs(own))


def test_a_write_the_components_do_not_name_is_refused_not_misattributed(embedded_tokenizer):
    """A plain torch hook that adds a constant to layer 0's output projection changes the model's residual
    stream without any head, MLP or bias writing it: the decomposition refuses instead of returning numbers
    that do not add up."""
    model = _wrapped("llama", embedded_tokenizer, seed=5)
    o_proj = model.bridge.blocks[0].attn.o.original_component
    handle = o_proj.register_forward_hook(lambda module, args, out: out + 0.5)
    try:
        with pytest.raises(InputError, match="cannot be written exactly"):
            direct_logit_attribution(model, IDS, ANSWER, WRONG)
    finally:
        handle.remove()
    assert direct_logit_attribution(model, IDS, ANSWER, WRONG).values.size


def test_a_parallel_attention_and_mlp_block_is_exact_too(embedded_tokenizer):
    """Phi-1/2 add attention and MLP side by side from one norm: the residual stream is still their sum."""
    from transformers import PhiConfig, PhiForCausalLM

    def phi():
        torch.manual_seed(0)
        hf = PhiForCausalLM(PhiConfig(vocab_size=len(embedded_tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4))
        hf.config.architectures, hf.config._attn_implementation = ["PhiForCausalLM"], "eager"
        return hf.eval()

    result = direct_logit_attribution(wrap_model(phi(), embedded_tokenizer, name="tiny-phi", digest="tiny-phi"),
                                      IDS, ANSWER, WRONG)
    with torch.no_grad():
        logits = phi()(torch.tensor([IDS])).logits[0, -1].double()
    own = float(logits[ANSWER] - logits[WRONG])
    assert abs(result.values.sum() - own) <= 1e-4 * abs(own)
