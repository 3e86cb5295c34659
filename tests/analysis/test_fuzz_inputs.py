"""Property-based tests of the analysis boundaries: whatever a user types or a link carries either
works or raises a clear ``ValueError`` (InputError, ModelError) — never another exception.

Texts include odd Unicode on purpose: zero-width and bidi controls, emoji, control characters,
lone surrogates (what undecodable bytes on a command line become) and very long strings.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from headscope.analysis.capture import capture, tokenize_input
from headscope.analysis.errors import InputError
from headscope.analysis.evidence import evidence_score
from headscope.analysis.niah import Needle, build_prompt, load_haystack, parse_needles
from tests.hostile_text import TEXT

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(TEXT)
def test_odd_texts_tokenize_or_say_why(tiny_model, text):
    try:
        ids = tokenize_input(tiny_model, text, 64)
    except ValueError as e:
        assert str(e)
        return
    assert 1 <= len(ids) <= 64 and all(isinstance(i, int) for i in ids)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(TEXT)
def test_odd_texts_capture_or_say_why(tiny_model, text):
    try:
        run = capture(tiny_model, text, max_tokens=64)
    except ValueError:
        return
    assert run.patterns.shape[-1] == run.n_tokens and all(isinstance(t, str) for t in run.tokens)
    np.testing.assert_allclose(np.asarray(run.patterns, dtype=np.float32).sum(-1), 1.0, atol=2e-2)


@FAST
@given(st.text(max_size=300))
@example("[" * 5000 + "]" * 5000)  # pasted JSON nested past the parser's recursion limit
@example('{"needles":' * 3000 + "[]" + "}" * 3000)
@example("[" + "9" * 5000 + "]")  # a numeral longer than int() converts
def test_needle_lists_parse_or_say_why(text):
    try:
        needles = parse_needles(text)
    except InputError as e:
        assert str(e)
        return
    assert needles and all(n.needle and n.question and n.answer for n in needles)


@FAST
@given(st.text(max_size=60))
def test_head_lists_parse_or_say_why(tiny_model, text):
    from headscope.analysis.ablation import parse_heads

    try:
        heads = parse_heads(tiny_model, text)
    except InputError as e:
        assert str(e)
        return
    assert heads == sorted(set(heads))
    assert all(0 <= la < tiny_model.n_layers and 0 <= h < tiny_model.n_heads for la, h in heads)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(-10, 5000), depth=st.floats(allow_nan=True, allow_infinity=True, width=32))
def test_prompt_lengths_and_depths_build_or_say_why(tiny_model, length, depth):
    needle = Needle("The vault code is 7731.", "What is the vault code?", "7731")
    try:
        prompt = build_prompt(tiny_model, needle, load_haystack("passkey"), length, depth)
    except InputError as e:
        assert str(e)
        return
    start, end = prompt.needle_span
    assert prompt.n_tokens <= length and 0 <= start < end <= prompt.n_tokens


@FAST
@given(st.lists(st.tuples(st.integers(-5, 12), st.integers(-5, 12)), min_size=0, max_size=3),
       st.tuples(st.integers(-5, 12), st.integers(-5, 12)))
def test_evidence_spans_score_or_say_why(question, evidence):
    rng = np.random.default_rng(0)
    p = np.tril(rng.random((2, 2, 8, 8)))
    p /= p.sum(-1, keepdims=True)
    try:
        s = evidence_score(p, question, evidence)
    except ValueError as e:
        assert str(e)
        return
    assert s.shape == (2, 2) and np.all((s >= 0) & (s <= 1 + 1e-9))


@FAST
@given(st.text(max_size=200))
def test_links_always_parse_and_round_trip(search):
    from headscope.app.url_state import parse

    state = parse(search)
    again = parse(state.to_search())
    assert again.problems == [] and again.to_search() == state.to_search()


if __name__ == "__main__":
    pytest.main([__file__])
