import numpy as np
import pytest
import torch

from headscope.analysis.capture import capture
from headscope.analysis.errors import InputError


def test_patterns_are_causal_probability_rows(tiny_model):
    run = capture(tiny_model, "The quick brown fox jumps over the lazy dog.", pattern_dtype="float32")
    n = run.n_tokens
    assert run.patterns.shape == (2, 4, n, n)
    np.testing.assert_allclose(run.patterns.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.triu(run.patterns, k=1) == 0)
    assert run.tokens[1] == "·quick"


def test_loss_and_top5_match_a_manual_forward(tiny_model):
    run = capture(tiny_model, "one two three four five", pattern_dtype="float32")
    with torch.no_grad():
        logits = tiny_model.bridge(torch.tensor([run.token_ids]))[0]
    logp = torch.log_softmax(logits, -1)
    expected = [-logp[i - 1, run.token_ids[i]].item() for i in range(1, run.n_tokens)]
    assert np.isnan(run.token_loss[0])
    np.testing.assert_allclose(run.token_loss[1:], expected, rtol=1e-5)
    top = torch.topk(logp[-1], 5)
    assert run.top_ids[-1].tolist() == top.indices.tolist()
    np.testing.assert_allclose(run.top_probs[-1], top.values.exp().numpy(), rtol=1e-5)


def test_qk_only_for_requested_layers(tiny_model):
    run = capture(tiny_model, "alpha beta gamma", qk_layers=[1])
    assert set(run.q) == {1} and set(run.k) == {1}
    assert run.q[1].shape == (4, run.n_tokens, 16)  # query heads
    assert run.k[1].shape == (2, run.n_tokens, 16)  # key-value heads, not repeated
    # post-rotary q·k / sqrt(d) reproduces the pattern (GQA: head h reads kv head h // 2)
    scores = np.einsum("hqd,hkd->hqk", run.q[1], np.repeat(run.k[1], 2, axis=0)) / 4.0
    n = run.n_tokens
    scores[:, np.triu_indices(n, 1)[0], np.triu_indices(n, 1)[1]] = -np.inf
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(probs, run.patterns[1].astype(np.float32), atol=2e-3)


def test_token_ids_are_used_exactly(tiny_model):
    ids = [5, 6, 7, 8]
    run = capture(tiny_model, ids)
    assert run.token_ids == ids and run.text is None


@pytest.mark.parametrize(
    "bad, message",
    [
        ("", "empty"),
        ("   \n ", "empty"),
        ("x" * 200_000, "limit"),
        ([10**9], "vocabulary"),
        ([], "no tokens"),
    ],
)
def test_bad_inputs_are_explained(tiny_model, bad, message):
    with pytest.raises(InputError, match=message):
        capture(tiny_model, bad)


@pytest.mark.parametrize("bad", [[5, 6.7], [5, 6.0], [True, 6], ["12", 6], [5, None], np.array([5.0, 6.0])],
                         ids=["fraction", "whole float", "bool", "numeral string", "None", "float array"])
def test_token_ids_that_are_not_whole_numbers_are_refused_not_truncated(tiny_model, bad):
    """A pasted or posted id list with 6.7 in it was read as token 6: a different text, analysed silently."""
    with pytest.raises(InputError, match="whole numbers"):
        capture(tiny_model, bad)


def test_integer_arrays_and_tensors_are_token_ids(tiny_model):
    for ids in (np.array([5, 6, 7], dtype=np.int64), torch.tensor([5, 6, 7]), (5, 6, 7)):
        assert capture(tiny_model, ids).token_ids == [5, 6, 7]


def test_token_limit_is_configurable_and_explained(tiny_model):
    with pytest.raises(InputError, match="limited to 8 tokens"):
        capture(tiny_model, "one two three four five six seven eight nine ten", max_tokens=8)


@pytest.mark.parametrize("text", ["word " * 600, "word " * 20_000], ids=["tokenised", "far too long"])
def test_a_text_longer_than_the_models_context_names_the_context_not_a_setting(tiny_model, text):
    """The tiny model reads at most 512 tokens: above that no setting helps, so none is named."""
    with pytest.raises(InputError) as e:
        capture(tiny_model, text)  # patterns allowed up to 2,048 tokens: the context is what binds
    assert "context of 512 tokens" in str(e.value) and "Shorten" in str(e.value)
    assert "HEADSCOPE_" not in str(e.value)


def test_stored_run_is_loaded_not_recomputed(tiny_model, store):
    first = capture(tiny_model, "cache me please", store=store)
    calls = []
    handle = tiny_model.bridge.blocks[0].attn.hook_pattern.register_forward_hook(lambda *a: calls.append(1))
    try:
        second = capture(tiny_model, "cache me please", store=store)
    finally:
        handle.remove()
    assert calls == [] and second.key == first.key
    np.testing.assert_array_equal(np.asarray(second.patterns), first.patterns)
    assert second.tokens == first.tokens


def test_corrupt_stored_run_is_recomputed_not_served(tiny_model, store):
    run = capture(tiny_model, "corrupt me", store=store)
    record = store.get(run.key)
    path = record.folder / "patterns.npy"
    data = bytearray(path.read_bytes())
    data[-4:] = b"\xff\xff\xff\xff"
    path.write_bytes(bytes(data))
    assert store.get(run.key) is None  # detected by checksum, dropped
    again = capture(tiny_model, "corrupt me", store=store)
    np.testing.assert_array_equal(np.asarray(again.patterns), run.patterns)
    assert store.get(run.key) is not None


@pytest.mark.integration
def test_patterns_equal_hugging_face_eager(real_model):
    """Independent reference: a separate HF model loaded from the same converted weights."""
    from transformers import AutoModelForCausalLM

    from headscope.analysis.models import converted_gguf, embedded_gguf

    folder, _ = converted_gguf(embedded_gguf())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    run = capture(real_model, "Attention heads decide where each token looks. " * 6, pattern_dtype="float32")
    with torch.no_grad():
        out = hf(torch.tensor([run.token_ids]), output_attentions=True)
    reference = np.stack([a[0].numpy() for a in out.attentions])
    assert reference.shape == run.patterns.shape == (30, 9, run.n_tokens, run.n_tokens)
    np.testing.assert_allclose(run.patterns, reference, atol=1e-5)
    lp = torch.log_softmax(out.logits[0], -1)
    np.testing.assert_allclose(
        run.token_loss[1:], [-lp[i - 1, t].item() for i, t in enumerate(run.token_ids) if i], rtol=1e-4
    )
    half = capture(real_model, run.token_ids)  # float16 storage: half the bytes, 1e-3 close
    assert half.patterns.dtype == np.float16
    np.testing.assert_allclose(half.patterns.astype(np.float32), reference, atol=1e-3)
