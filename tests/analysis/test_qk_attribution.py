"""QK attribution: the c × c' terms add up to the model's own pre-softmax score in every family (RoPE, partial
RoPE, QK-norm per head and across heads, GQA, biases, soft-capping, LayerNorm), the score and one term equal a
plain-hook computation on a fresh Hugging Face copy, and the embedded model."""

import importlib

import numpy as np
import pytest
import torch

from headscope.analysis.errors import InputError
from headscope.analysis.models import wrap_model
from headscope.analysis.qk_attribution import qk_attribution
from headscope.analysis.residual_components import capture_components
from tests.analysis.circuit_reference import reference_score
from tests.tiny_families import FAMILIES, REFUSED, tiny_family_model

IDS = [1, 5, 9, 200, 7, 8, 9, 10, 300, 301, 7, 8]


def _wrapped(family, tokenizer, seed=0):
    hf = tiny_family_model(family, len(tokenizer), seed=seed)
    return wrap_model(hf, tokenizer, name=f"tiny-{family}", digest=f"tiny-{family}-seed{seed}")


def _eager_scores(family, tokenizer, layer, seed=0):
    """``[head, query, key]`` scores before softmax of a fresh, unwrapped copy, hooked on its eager attention
    function's inputs: ``scaling · q kᵀ`` with the key-value heads repeated, as Hugging Face computes them."""
    hf = tiny_family_model(family, len(tokenizer), seed=seed)
    attn = (hf.transformer.h if family == "gpt2" else hf.model.layers)[layer]
    attn = attn.attn if family == "gpt2" else attn.self_attn
    seen = {}
    mod = importlib.import_module(type(attn).__module__)
    original = mod.eager_attention_forward

    def eager(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if module is attn:
            k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
            scale = scaling if scaling is not None else module.scaling
            seen["scores"] = (query.double() @ k.double().transpose(-1, -2))[0] * scale
        return original(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    mod.eager_attention_forward = eager
    try:
        with torch.no_grad():
            hf(torch.tensor([IDS]))
    finally:
        mod.eager_attention_forward = original
    return seen["scores"]


CELLS = [(0, 0, 11, 11), (1, 3, 11, 6), (-1, 1, 10, 5)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_terms_add_up_to_the_models_own_score_in_every_family(family, embedded_tokenizer):
    model = _wrapped(family, embedded_tokenizer)
    for layer, head, query, key in CELLS:
        layer = layer % model.n_layers
        result = qk_attribution(model, IDS, layer, head, query, key)
        own = float(_eager_scores(family, embedded_tokenizer, layer)[head, query, key])
        assert abs(result.score - own) <= 1e-4 * abs(own), (layer, head, query, key)
        assert abs(result.terms.sum() - own) <= 1e-4 * abs(own), (layer, head, query, key)
        n = 2 + layer * (model.n_heads + 1) + 1
        assert result.terms.shape == (n, n)
        np.testing.assert_allclose(result.query_sums.sum(), result.key_sums.sum(), rtol=1e-12)
        assert result.query_names == result.key_names and result.query_names[-1] == "input_bias"
        if family == "gemma2":
            assert result.softcap == 5.0 and result.capped_score == pytest.approx(5.0 * np.tanh(result.score / 5.0))
        else:
            assert result.softcap is None and result.capped_score == result.score


def test_the_score_and_the_embedding_term_equal_a_plain_hook_reference(embedded_tokenizer):
    model = _wrapped("llama", embedded_tokenizer, seed=2)
    result = qk_attribution(model, IDS, 1, 3, 11, 6)
    score, embed_term = reference_score(tiny_family_model("llama", len(embedded_tokenizer), seed=2), IDS, 1, 3, 11, 6)
    assert abs(result.score - score) <= 1e-5 * abs(score)
    e = result.query_names.index("embed")
    assert result.terms[e, e] == pytest.approx(embed_term, rel=1e-5)


def test_rows_and_columns_name_the_components_written_before_the_layer(embedded_tokenizer):
    model = _wrapped("gemma3", embedded_tokenizer)
    result = qk_attribution(model, IDS, 2, 0, 5, 4)
    assert result.query_names == ["embed", *[f"{a}.{h}" for a in range(2) for h in range(4)], "mlp.0", "mlp.1",
                                  "bias", "input_bias"]
    first = qk_attribution(model, IDS, 0, 0, 5, 4)
    assert first.query_names == ["embed", "bias", "input_bias"]


def test_one_capture_serves_several_cells(embedded_tokenizer):
    model = _wrapped("olmo2", embedded_tokenizer)
    capture = capture_components(model, IDS, [3, 7, 11], attention_layers=[1])
    for query, key in ((11, 7), (7, 3), (11, 3), (3, 3)):
        reused = qk_attribution(model, IDS, 1, 2, query, key, capture=capture)
        fresh = qk_attribution(model, IDS, 1, 2, query, key)
        np.testing.assert_allclose(reused.terms, fresh.terms, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("layer, head, query, key, message", [
    (0, 0, 3, 5, "after query"),
    (0, 0, 12, 0, "outside the text"),
    (0, 0, -1, 0, "outside the text"),
    (0, 0, 3.5, 0, "outside the text"),
    (0, 0, True, 0, "outside the text"),
    (0, 0, "3", 0, "outside the text"),
    (2, 0, 3, 0, "out of range"),
    (0, 4, 3, 0, "out of range"),
    ("x", 0, 3, 0, "whole"),
    (-1, 0, 3, 0, "out of range"),
])
def test_hostile_cells_are_refused_with_a_message(layer, head, query, key, message, embedded_tokenizer):
    with pytest.raises(InputError, match=message):
        qk_attribution(_wrapped("llama", embedded_tokenizer), IDS, layer, head, query, key)


def test_a_key_outside_the_sliding_window_is_refused(embedded_tokenizer):
    model = _wrapped("mistral", embedded_tokenizer)  # window 7
    with pytest.raises(InputError, match="sliding window of 7"):
        qk_attribution(model, IDS, 1, 0, 11, 4)
    assert qk_attribution(model, IDS, 1, 0, 11, 5).terms.size


@pytest.mark.parametrize("family", list(REFUSED))
def test_a_family_the_decomposition_does_not_know_is_refused(family, embedded_tokenizer):
    with pytest.raises(InputError, match="statistics mode"):
        qk_attribution(_wrapped(family, embedded_tokenizer), IDS, 1, 0, 5, 2)


def test_the_embedded_model_adds_up_and_matches_the_reference(real_model):
    from transformers import AutoModelForCausalLM

    from headscope.analysis.models import converted_gguf, embedded_gguf

    ids = real_model.input_ids("The quick brown fox jumps over the lazy dog because the dog was lazy")
    query, key = len(ids) - 1, len(ids) - 6
    result = qk_attribution(real_model, ids, 12, 4, query, key)
    folder, _ = converted_gguf(embedded_gguf())
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    score, embed_term = reference_score(hf, ids, 12, 4, query, key)
    assert abs(result.score - score) <= 1e-4 * abs(score)
    assert abs(result.terms.sum() - score) <= 1e-4 * abs(score)
    e = result.query_names.index("embed")
    assert result.terms[e, e] == pytest.approx(embed_term, rel=1e-4)
    assert result.terms.shape == (2 + 12 * 10 + 1,) * 2


def test_a_key_the_components_do_not_build_is_refused_not_misattributed(embedded_tokenizer):
    """A plain torch hook that shifts layer 1's key projection makes the model's k differ from what the
    components build: refused, never a matrix that does not add up to the score."""
    model = _wrapped("qwen2", embedded_tokenizer, seed=5)
    k_proj = model.bridge.blocks[1].attn.k.original_component
    handle = k_proj.register_forward_hook(lambda module, args, out: out * 1.01)
    try:
        with pytest.raises(InputError, match="cannot be written exactly"):
            qk_attribution(model, IDS, 1, 0, 11, 3)
    finally:
        handle.remove()
    assert qk_attribution(model, IDS, 1, 0, 11, 3).terms.size


def test_the_known_induction_circuit_shows_on_the_key_side(real_model):
    """Olsson et al. 2022: on repeated random tokens the top induction head's key side is built mostly by an
    earlier previous-token head (bench/induction_circuit.py prints the whole table)."""
    g = torch.Generator().manual_seed(0)
    r = torch.randint(1000, 20000, (40,), generator=g).tolist()
    ids, n = r + r, 40
    patterns = {}
    hooks = [(f"blocks.{a}.attn.hook_pattern", lambda t, hook, a=a: patterns.__setitem__(a, t[0].detach()))
             for a in range(real_model.n_layers)]
    with real_model.lock, torch.inference_mode():
        real_model.bridge.run_with_hooks(torch.tensor([ids]), fwd_hooks=hooks, return_type=None)
    rows, every = torch.arange(n, 2 * n), torch.arange(1, 2 * n)
    induction = torch.stack([patterns[a][:, rows, rows - n + 1].mean(-1) for a in range(real_model.n_layers)])
    previous = torch.stack([patterns[a][:, every, every - 1].mean(-1) for a in range(real_model.n_layers)])
    layer, head = divmod(int(induction.argmax()), real_model.n_heads)
    assert induction[layer, head] > 0.5
    query = 2 * n - 3
    result = qk_attribution(real_model, ids, layer, head, query, query - n + 1)
    top = result.key_names[int(np.argmax(result.key_sums))]
    sender_layer, sender_head = (int(x) for x in top.split("."))
    assert sender_layer < layer and previous[sender_layer, sender_head] > 0.5
    assert result.key_sums.max() > 0.5 * result.score
