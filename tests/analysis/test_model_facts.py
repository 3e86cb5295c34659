"""Per-model facts (windows, BOS policy, chat template, which q/k the QK page shows) on tiny random
models of several families, and entropy normalised by the keys a windowed layer can see."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from headscope.analysis.capture import capture
from headscope.analysis.entropy import normalised_entropy
from headscope.analysis.models import wrap_model
from headscope.analysis.statistics_run import capture_statistics
from tests.tiny_families import tiny_family_model

WINDOWS = {"llama": (None, None), "mistral": (7, 7), "gemma2": (6, None), "gemma3": (6, None, 6),
           "qwen3": (None, None), "gpt2": (None, None)}


def _wrap(family, tokenizer, blind_queries=False):
    hf = tiny_family_model(family, len(tokenizer))
    if blind_queries:  # q = 0 in every layer: every score equal, each row uniform over its visible keys
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "q_proj" in name:
                    p.zero_()
    return wrap_model(hf, tokenizer, name=f"tiny-{family}{'-blind' if blind_queries else ''}",
                      digest=f"tiny-{family}-blind{int(blind_queries)}")


@pytest.mark.parametrize("family", list(WINDOWS))
def test_windows_per_layer_come_from_the_model(family, embedded_tokenizer):
    model = _wrap(family, embedded_tokenizer)
    assert model.facts.windows == WINDOWS[family]
    assert model.facts.windowed == any(WINDOWS[family])


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_a_uniform_head_over_its_window_has_entropy_one_in_both_modes(family, embedded_tokenizer):
    """With zero queries every head spreads evenly over the keys it can see: on a sliding-window
    layer that is the last W keys, not all i + 1, so the normalised entropy is 1 on every layer
    (DESIGN.md: row entropy / log(number of visible keys)), in the pattern path and statistics mode."""
    model = _wrap(family, embedded_tokenizer, blind_queries=True)
    ids = list(range(100, 140))  # 40 tokens, far past every window
    run = capture(model, ids, pattern_dtype="float32", max_tokens=len(ids))
    # the patterns really are uniform over the window: row 30 of a windowed layer has W non-zero keys
    first_windowed = next(i for i, w in enumerate(WINDOWS[family]) if w)
    w = WINDOWS[family][first_windowed]
    np.testing.assert_allclose(run.patterns[first_windowed, 0, 30, 31 - w : 31], 1.0 / w, rtol=1e-5)
    np.testing.assert_allclose(run.head_scores("entropy"), 1.0, atol=1e-5)
    stats = capture_statistics(model, ids)
    np.testing.assert_allclose(stats.head_scores("entropy"), 1.0, atol=1e-5)


def test_entropy_by_hand_on_a_window_of_two():
    # rows of a window-2 layer: [1], [.5 .5], [0 .5 .5], [0 0 .9 .1] -> visible keys 1, 2, 2, 2
    a = np.array([[1, 0, 0, 0], [0.5, 0.5, 0, 0], [0, 0.5, 0.5, 0], [0, 0, 0.9, 0.1]])
    h3 = -(0.9 * np.log(0.9) + 0.1 * np.log(0.1)) / np.log(2)
    np.testing.assert_allclose(normalised_entropy(a[None, None], windows=[2]), [[(1 + 1 + h3) / 3]], rtol=1e-12)
    full = (1 + 1 / np.log(3) * np.log(2) + h3 * np.log(2) / np.log(4)) / 3  # the old log(i + 1) reading
    np.testing.assert_allclose(normalised_entropy(a[None, None]), [[full]], rtol=1e-12)


@pytest.fixture(scope="module")
def base_tokenizer(embedded_tokenizer):
    """The embedded tokenizer made to behave like Gemma 3 270M's: it puts a BOS before a text, and
    the model is a base model without a chat template (a copy: the session's tokenizer stays as it is)."""
    tok = copy.deepcopy(embedded_tokenizer)
    tok.add_bos_token = True
    tok.chat_template = None
    assert tok("a")["input_ids"][0] == tok.bos_token_id  # the copy really prepends its BOS
    return tok


def test_a_model_without_bos_reads_text_as_written(embedded_tokenizer):
    model = _wrap("mistral", embedded_tokenizer)
    assert not model.facts.adds_bos  # SmolLM2's tokenizer adds nothing: text is encoded as written
    assert model.facts.has_chat_template
    run = capture(model, "The cat sat.")
    assert run.token_ids == embedded_tokenizer.encode("The cat sat.", add_special_tokens=False)


def test_a_model_that_expects_bos_gets_it_as_a_visible_token(base_tokenizer):
    """Gemma-like: the BOS is prepended once, is position 0 of the run and is shown as a token; the
    statistics run sees the same ids."""
    model = _wrap("gemma3", base_tokenizer)
    bos = base_tokenizer.bos_token_id
    assert model.facts.bos_id == bos and not model.facts.has_chat_template
    plain = base_tokenizer.encode("The cat sat.", add_special_tokens=False)
    run = capture(model, "The cat sat.")
    assert run.token_ids == [bos, *plain]
    assert run.tokens[0] == base_tokenizer.bos_token  # shown, not hidden
    assert run.patterns.shape[-1] == len(plain) + 1
    assert capture_statistics(model, "The cat sat.").token_ids == run.token_ids
    assert capture(model, run.token_ids).token_ids == run.token_ids  # ids are used as given: no second BOS


def test_niah_prompt_of_a_base_model_is_the_plain_message_after_bos(base_tokenizer):
    from headscope.analysis.niah import Needle, build_prompt, load_haystack

    model = _wrap("gemma3", base_tokenizer)
    needle = Needle("The secret colour of the lighthouse is teal.", "What is the secret colour of the lighthouse?",
                    "teal")
    p = build_prompt(model, needle, load_haystack("prose"), 200, 50)
    assert p.token_ids == [base_tokenizer.bos_token_id, *base_tokenizer.encode(p.text, add_special_tokens=False)]
    assert "<|im_start|>" not in base_tokenizer.decode(p.token_ids[1:])  # no chat turn markers
    a, b = p.needle_span
    assert base_tokenizer.decode(p.token_ids[a:b]).strip() == needle.needle


def test_qk_page_label_names_norm_and_rotation(embedded_tokenizer):
    assert _wrap("llama", embedded_tokenizer).facts.qk_label.startswith("q and k after RoPE")
    assert "QK-norm (per head) and RoPE" in _wrap("qwen3", embedded_tokenizer).facts.qk_label
    assert "absolute positions" in _wrap("gpt2", embedded_tokenizer).facts.qk_label



def test_qk_probe_sentences_start_with_the_bos_the_model_expects(base_tokenizer):
    """QK page probes of a BOS model: each sentence is read after its BOS (a point shown as a token,
    with no characters of the sentence), and the queries are those of the model run on [BOS] + text."""
    from transformer_lens.utilities import get_act_name

    from headscope.analysis.qk_collect import collect_layer

    model = _wrap("gemma3", base_tokenizer)
    sentences = ["The cat sat on the mat.", "A dog ran home."]
    qk = collect_layer(model, sentences, 1)
    bos = base_tokenizer.bos_token_id
    first = [bos, *base_tokenizer.encode(sentences[0], add_special_tokens=False)]
    assert qk.token_ids[: len(first)].tolist() == first
    assert qk.tokens[0] == base_tokenizer.bos_token
    assert qk.char_spans[0].tolist() == [0, 0] and qk.char_spans[1, 0] == 0  # "The" starts the text
    with torch.inference_mode():
        _, cache = model.bridge.run_with_cache(torch.tensor([first]))
    want = cache[get_act_name("rot_q", 1)][0]  # [pos, head, d_head]
    np.testing.assert_allclose(qk.q_rot[: len(first)], want.numpy(), atol=1e-4)


def test_the_bos_and_template_policy_in_one_line(embedded_tokenizer, base_tokenizer):
    """What the pages say about how a text becomes tokens: a base model like Gemma 3 270M, and
    SmolLM2's tokenizer (no BOS added, a chat template)."""
    assert _wrap("gemma3", base_tokenizer).facts.prompt_policy == (
        "BOS prepended (shown as token 0) · chat template: no (plain prompt)")
    assert _wrap("mistral", embedded_tokenizer).facts.prompt_policy == (
        "no BOS (text read as written) · chat template: yes")


def test_a_runs_policy_says_its_text_was_not_wrapped_in_a_chat_template(embedded_tokenizer, base_tokenizer):
    """The Attention page's chip: a text run is read as written whether or not the model has a chat
    template (only needle-in-a-haystack prompts are wrapped in it); ids are used as given."""
    assert _wrap("gemma3", base_tokenizer).facts.run_policy(True) == (
        "BOS prepended (shown as token 0) · text as written, no chat template applied")
    smol = _wrap("mistral", embedded_tokenizer).facts
    assert smol.has_chat_template and smol.run_policy(True) == "no BOS · text as written, no chat template applied"
    assert smol.run_policy(False) == "token ids as given (no BOS added, no chat template applied)"
