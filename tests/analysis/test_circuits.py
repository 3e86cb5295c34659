"""analysis/circuits.py on a tiny random model: what the Circuits page and ``headscope circuits`` store is what
they read back (the attribution, the composition scores once per model digest), and what a user types wrong is
refused with a message that says what to do."""

from __future__ import annotations

import numpy as np
import pytest

from headscope.analysis.circuits import (
    circuits,
    composition_key,
    explain,
    load_circuits,
    load_composition,
    load_explained,
    stored_composition,
)
from headscope.analysis.composition import composition_scores
from headscope.analysis.errors import InputError
from headscope.analysis.logit_attribution import direct_logit_attribution
from headscope.analysis.qk_attribution import qk_attribution

TEXT = "When Mary and John went to the store, John gave a drink to"


def _one_token_answers(model) -> list[str]:
    """Two texts the tiny model's tokenizer (the embedded one) reads as one token each."""
    found = [w for w in (" Mary", " John", " the", " a") if len(model.encode(w)) == 1]
    return found[:2]


def test_circuits_is_the_attribution_and_is_read_back_from_the_store(tiny_model, store):
    answers = _one_token_answers(tiny_model)
    seen = []
    result = circuits(tiny_model, TEXT, answers, store=store, progress=seen.append)
    ids = tiny_model.input_ids(TEXT)
    direct = direct_logit_attribution(tiny_model, ids, tiny_model.encode(answers[0])[0], tiny_model.encode(answers[1])[0])
    np.testing.assert_allclose(result.attribution.values, direct.values, rtol=1e-9, atol=1e-12)
    assert result.attribution.values.sum() == pytest.approx(result.attribution.logit_diff, rel=1e-4)
    assert seen[-1] == 1.0 and result.token_ids == ids
    again = load_circuits(store, result.key)
    assert again.attribution.names == result.attribution.names and again.answer_tokens == result.answer_tokens
    np.testing.assert_array_equal(again.attribution.values, result.attribution.values)
    assert circuits(tiny_model, TEXT, answers, store=store).key == result.key


def test_composition_is_stored_once_per_model(tiny_model, store):
    first = stored_composition(tiny_model, store)
    key = composition_key(tiny_model)
    assert store.get(key).kind == "composition"
    stored = load_composition(store, key)
    direct = composition_scores(tiny_model)
    for kind in ("q", "k", "v"):
        np.testing.assert_allclose(stored.of(kind), direct.of(kind), rtol=1e-6, atol=1e-7)  # float32 in the store
        np.testing.assert_array_equal(first.of(kind), stored.of(kind))
    heard = []
    stored_composition(tiny_model, store, progress=heard.append)
    assert heard == [1.0]  # found: nothing computed


def test_explain_is_the_qk_attribution_and_is_read_back(tiny_model, store):
    ids = tiny_model.input_ids(TEXT)
    cell = explain(tiny_model, TEXT, 1, 0, 5, 2, store=store)
    direct = qk_attribution(tiny_model, ids, 1, 0, 5, 2)
    np.testing.assert_allclose(cell.attribution.terms, direct.terms, rtol=1e-9, atol=1e-12)
    again = load_explained(store, cell.key)
    assert again.attribution.score == cell.attribution.score and again.tokens == cell.tokens
    assert again.attribution.terms.sum() == pytest.approx(again.attribution.score, rel=1e-4, abs=1e-9)


HOSTILE = [
    ("one answer", TEXT, [" Mary"], "two answers"),
    ("three answers", TEXT, [" Mary", " John", " the"], "two answers"),
    ("a string, not two", TEXT, " Mary, John", "two answers"),
    ("empty answer", TEXT, ["", " John"], "empty"),
    ("a bool as an answer", TEXT, [True, " John"], "empty"),
    ("an id outside the vocabulary as an answer", TEXT, [10**9, " John"], "outside the vocabulary"),
    ("many tokens", TEXT, [" Maryland Johnsonville", " John"], "tokens"),
    ("the same token twice", TEXT, [" John", " John"], "same token"),
    ("empty text", "   ", [" Mary", " John"], "empty"),
    ("ids outside the vocabulary", [10**9, 3], [" Mary", " John"], "vocabulary"),
]


def test_an_answer_given_as_its_token_id_is_that_token(tiny_model):
    """Answers are taken as patching takes them: a one-token string or its id, the same attribution."""
    by_text = circuits(tiny_model, TEXT, [" Mary", " John"], composition=False)
    mary = tiny_model.encode(" Mary")
    assert len(mary) == 1
    by_id = circuits(tiny_model, TEXT, [mary[0], " John"], composition=False)
    assert by_id.answer_tokens == by_text.answer_tokens
    np.testing.assert_array_equal(by_id.attribution.values, by_text.attribution.values)


@pytest.mark.parametrize("text, answers, said", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_a_wrong_request_is_refused_with_a_message(tiny_model, store, text, answers, said):
    with pytest.raises(InputError, match=said):
        circuits(tiny_model, text, answers, store=store, composition=False)
    assert store.list() == []  # nothing stored
