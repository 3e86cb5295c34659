"""Tests for analysis/qk_collect.py: probe sets, q/k collection, GQA, the store, limits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from headscope.analysis.capture import capture
from headscope.analysis.errors import InputError
from headscope.analysis.qk_collect import (
    causal_softmax,
    collect_head,
    collect_layer,
    collect_layers,
    load_probe_tasks,
    load_sentences,
)

SENTENCES = [
    "The red fox ran past the blue car.",
    "A cat and a dog slept by the fire.",
    "She played the violin on Monday and the piano on Friday.",
]


def test_attention_from_collected_vectors_equals_the_models_pattern(tiny_model):
    """q·k/sqrt(d) softmax over the collected post-rotary vectors is the model's own hook_pattern."""
    for head in (0, 3):
        h = collect_head(tiny_model, SENTENCES, layer=1, head=head)
        assert h.kv_head == head // 2  # 4 query heads read 2 key-value heads
        for s, text in enumerate(SENTENCES):
            run = capture(tiny_model, tiny_model.encode(text), qk_layers=[1], pattern_dtype="float32")
            np.testing.assert_allclose(h.attention(s), run.patterns[1, head], atol=1e-5)
            np.testing.assert_allclose(h.k[h.rows(s)], run.k[1][head // 2], atol=1e-5)
            assert h.tokens[h.rows(s)] == run.tokens
            assert h.positions[h.rows(s)].tolist() == list(range(run.n_tokens))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_attention_from_collected_vectors_uses_the_layers_scale_cap_and_window(family, embedded_tokenizer):
    """Gemma's logits are ``q · k / sqrt(query_pre_attn_scalar)`` (not ``sqrt(d_head)``), soft-capped
    (Gemma 2) and windowed on sliding layers: the collected vectors' attention is still the model's."""
    from headscope.analysis.models import wrap_model
    from tests.tiny_families import tiny_family_model

    model = wrap_model(tiny_family_model(family, len(embedded_tokenizer)), embedded_tokenizer,
                       name=f"tiny-{family}-qk", digest=f"tiny-{family}-qk")
    assert max(len(model.encode(text)) for text in SENTENCES) > 6  # longer than the window
    for layer, qk in collect_layers(model, SENTENCES, list(range(model.n_layers))).items():
        h = qk.head(1)
        for s, text in enumerate(SENTENCES):
            run = capture(model, model.encode(text), pattern_dtype="float32")
            np.testing.assert_allclose(h.attention(s), run.patterns[layer, 1], atol=1e-5)


def test_second_request_for_any_head_of_the_layer_runs_nothing(tiny_model, store, monkeypatch):
    first = collect_head(tiny_model, SENTENCES, layer=0, head=1, store=store)

    def boom(*a, **k):
        raise AssertionError("the model ran again")

    monkeypatch.setattr(tiny_model.bridge, "run_with_hooks", boom)
    again = collect_head(tiny_model, SENTENCES, layer=0, head=1, store=store)
    np.testing.assert_array_equal(first.q, again.q)
    np.testing.assert_array_equal(first.k, again.k)
    assert again.tokens == first.tokens and again.sentences == SENTENCES
    other = collect_head(tiny_model, SENTENCES, layer=0, head=2, store=store)  # same layer: stored
    assert other.kv_head == 1


def test_pre_rotary_vectors_are_rotations_of_the_post_rotary_ones(tiny_model):
    post = collect_head(tiny_model, SENTENCES, layer=1, head=2)
    pre = collect_head(tiny_model, SENTENCES, layer=1, head=2, rotary=False)
    # RoPE rotates pairs of dimensions: norms are kept, position 0 is not rotated at all.
    np.testing.assert_allclose(pre.q_norm, post.q_norm, rtol=1e-5)
    np.testing.assert_allclose(pre.k_norm, post.k_norm, rtol=1e-5)
    first = post.positions == 0
    np.testing.assert_allclose(pre.q[first], post.q[first], atol=1e-6)
    assert np.abs(pre.q[~first] - post.q[~first]).max() > 1e-2
    np.testing.assert_allclose(pre.attention(0), post.attention(0))  # attention always post-rotary


def test_limits_and_bad_requests_are_explained(tiny_model):
    with pytest.raises(InputError, match="fewer sentences"):
        collect_head(tiny_model, SENTENCES, layer=0, head=0, max_points=20)
    with pytest.raises(InputError, match="Head 4 is out of range"):
        collect_head(tiny_model, SENTENCES, layer=0, head=4)
    with pytest.raises(InputError, match="Layer 2 is out of range"):
        collect_layer(tiny_model, SENTENCES, layer=2)
    with pytest.raises(InputError, match="empty"):
        collect_layer(tiny_model, ["fine", "  "], layer=0)
    with pytest.raises(InputError, match="list of sentences"):
        collect_layer(tiny_model, "one string", layer=0)


def test_char_spans_and_point_table(tiny_model):
    h = collect_head(tiny_model, SENTENCES, layer=0, head=0)
    for s, text in enumerate(SENTENCES):
        r = h.rows(s)
        pieces = [text[a:b] for a, b in h.char_spans[r]]
        assert "".join(pieces) == text
    table = h.point_table()
    assert len(table["kind"]) == h.n_points == 2 * h.n_tokens
    assert table["kind"][0] == "query" and table["kind"][h.n_tokens] == "key"
    assert table["text"][h.n_tokens] == SENTENCES[0]


def test_subset_keeps_whole_sentences(tiny_model):
    h = collect_head(tiny_model, SENTENCES, layer=0, head=0)
    sub = h.subset([2, 0])
    assert sub.sentences == [SENTENCES[2], SENTENCES[0]]
    np.testing.assert_allclose(sub.attention(0), h.attention(2))
    np.testing.assert_allclose(sub.attention(1), h.attention(0))


def test_shipped_probe_sets():
    sentences = load_sentences()
    assert len(sentences) >= 300 and len(set(sentences)) == len(sentences)
    tasks = load_probe_tasks()
    assert {t.kind for t in tasks.values()} == {"category", "same_token", "previous_token"}
    cat = next(t for t in tasks.values() if t.kind == "category")
    assert len(cat.lexicon) >= 5 and len(cat.sentences) >= 50


def test_bad_probe_files_are_explained(tmp_path):
    bad = tmp_path / "f.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_probe_tasks(bad)
    bad.write_text(json.dumps({"tasks": [{"name": "x", "kind": "colour", "sentences": ["a"]}]}))
    with pytest.raises(InputError, match="kind 'colour'"):
        load_probe_tasks(bad)
    bad.write_text(json.dumps({"tasks": [{"name": "x", "kind": "category", "sentences": ["a"], "lexicon": {"a": ["b"]}}]}))
    with pytest.raises(InputError, match="at least two categories"):
        load_probe_tasks(bad)
    empty = tmp_path / "s.txt"
    empty.write_text("# only a comment\n\n")
    with pytest.raises(InputError, match="no sentences"):
        load_sentences(empty)


def test_causal_softmax_rows():
    logits = np.array([[0.0, -np.inf], [1.0, 1.0]])
    np.testing.assert_allclose(causal_softmax(logits), [[1.0, 0.0], [0.5, 0.5]])
