"""Per-model facts (windows, BOS policy, chat template, which q/k the QK page shows) on tiny random
models of several families, and entropy normalised by the keys a windowed layer can see."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from analysis.capture import capture
from analysis.entropy import normalised_entropy
from analysis.models import wrap_model
from analysis.statistics_run import capture_statistics
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


def test_bos_policy_follows_the_tokenizer(embedded_tokenizer):
    model = _wrap("mistral", embedded_tokenizer)
    assert not model.facts.adds_bos  # SmolLM2's tokenizer adds nothing: text is encoded as written
    assert model.facts.has_chat_template


def test_qk_page_label_names_norm_and_rotation(embedded_tokenizer):
    assert _wrap("llama", embedded_tokenizer).facts.qk_label.startswith("q and k after RoPE")
    assert "QK-norm (per head) and RoPE" in _wrap("qwen3", embedded_tokenizer).facts.qk_label
    assert "absolute positions" in _wrap("gpt2", embedded_tokenizer).facts.qk_label

